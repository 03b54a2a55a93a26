//! The library's log, set up from the environment once per process (the
//! model is NCCL's `NCCL_DEBUG` and `NCCL_DEBUG_FILE`):
//!
//! - `EP_LOG_LEVEL`: `off`, `warn` (default: failed calls and problems),
//!   `info` (plus a summary of every context made: version, backend, device,
//!   node shape, buffers, kernels), `debug` (plus one line per operation: its
//!   shape and the path it takes), `trace` (plus every API call and its
//!   status and time).
//! - `EP_LOG_FILE`: write to this file (appended) instead of stderr; `%h` in
//!   the name becomes the host name, `%p` the process id, `%%` a `%`.
//!
//! Every line starts with the host name, the process id, and the rank and
//! device of the context the calling thread is working on:
//!
//! ```text
//! node7:4242 [rank 1/8 dev 1] EP INFO GPU backend: NVIDIA H200, ...
//! ```
//!
//! The rank and device come from a thread-local set by the C boundary when an
//! entry point has found its context ([`enter`]); `-` where there is none.
//! A disabled level costs one relaxed load per log statement.

use super::config::{BackendKind, Config};
use once_cell::sync::Lazy;
use std::cell::Cell;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::sync::Mutex;

/// How much the log says; each level includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off = 0,
    Warn = 1,
    Info = 2,
    Debug = 3,
    Trace = 4,
}

impl Level {
    /// The level named `text` (case-insensitive), as `EP_LOG_LEVEL` takes it.
    pub fn parse(text: &str) -> Option<Level> {
        match text.trim().to_ascii_lowercase().as_str() {
            "off" | "none" => Some(Level::Off),
            "warn" | "warning" => Some(Level::Warn),
            "info" => Some(Level::Info),
            "debug" => Some(Level::Debug),
            "trace" => Some(Level::Trace),
            _ => None,
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Level::Off => "OFF",
            Level::Warn => "WARN",
            Level::Info => "INFO",
            Level::Debug => "DEBUG",
            Level::Trace => "TRACE",
        }
    }
}

/// The level when `EP_LOG_LEVEL` is unset.
const DEFAULT_LEVEL: Level = Level::Warn;

/// `EP_LOG_FILE`'s pattern with `%h` replaced by `host`, `%p` by `pid` and
/// `%%` by `%`; any other `%` stays as it is.
pub fn expand_file_name(pattern: &str, host: &str, pid: u32) -> String {
    let mut out = String::with_capacity(pattern.len() + host.len());
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('h') => out.push_str(host),
            Some('p') => out.push_str(&pid.to_string()),
            Some('%') => out.push('%'),
            _ => {
                out.push('%');
                continue;
            }
        }
        chars.next();
    }
    out
}

/// Which context a thread is working on, for the line prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Who {
    pub rank: usize,
    pub world: usize,
    /// The CUDA device; `None` on the host backend.
    pub device: Option<i32>,
}

thread_local! {
    static WHO: Cell<Option<Who>> = const { Cell::new(None) };
}

impl Who {
    /// The rank and device of a context with configuration `cfg`.
    pub fn of(cfg: &Config) -> Who {
        Who {
            rank: cfg.rank,
            world: cfg.world(),
            device: (cfg.backend == BackendKind::Gpu).then_some(cfg.device),
        }
    }
}

/// Marks the calling thread as working on the context configured by `cfg`
/// until [`leave`] (the C boundary's `run` leaves when the call returns).
pub fn enter(cfg: &Config) {
    WHO.with(|w| w.set(Some(Who::of(cfg))));
}

/// Clears the calling thread's context and returns the one it had.
pub fn leave() -> Option<Who> {
    WHO.with(|w| w.replace(None))
}

/// Restores a context returned by [`leave`].
pub fn restore(who: Option<Who>) {
    WHO.with(|w| w.set(who));
}

/// One log line, newline included.
pub fn format_line(level: Level, who: Option<Who>, host: &str, pid: u32, message: &str) -> String {
    let (rank, device) = match who {
        Some(w) => (
            format!("{}/{}", w.rank, w.world),
            w.device.map_or("host".to_string(), |d| d.to_string()),
        ),
        None => ("-".to_string(), "-".to_string()),
    };
    format!(
        "{host}:{pid} [rank {rank} dev {device}] EP {} {message}\n",
        level.tag()
    )
}

/// Where lines go.
enum Sink {
    Stderr,
    /// The file for process `pid` (a forked child opens its own when the
    /// name has `%p`).
    File {
        file: File,
        pid: u32,
    },
}

struct Logger {
    level: Level,
    host: String,
    /// `EP_LOG_FILE` as given.
    pattern: Option<String>,
    sink: Mutex<Sink>,
}

static LOGGER: Lazy<Logger> = Lazy::new(Logger::from_env);

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: writes at most `buf.len()` bytes.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok && len > 0 {
        String::from_utf8_lossy(&buf[..len]).into_owned()
    } else {
        "unknown-host".to_string()
    }
}

fn open(name: &str) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).open(name)
}

impl Logger {
    fn from_env() -> Logger {
        let host = host_name();
        let mut notes = Vec::new();
        let level = match std::env::var("EP_LOG_LEVEL") {
            Err(_) => DEFAULT_LEVEL,
            Ok(text) if text.trim().is_empty() => DEFAULT_LEVEL,
            Ok(text) => Level::parse(&text).unwrap_or_else(|| {
                notes.push(format!(
                    "EP_LOG_LEVEL={text:?} is not off, warn, info, debug or trace; using warn"
                ));
                DEFAULT_LEVEL
            }),
        };
        let pattern = std::env::var("EP_LOG_FILE")
            .ok()
            .filter(|p| !p.trim().is_empty());
        let pid = std::process::id();
        let sink = match &pattern {
            None => Sink::Stderr,
            Some(p) => {
                let name = expand_file_name(p, &host, pid);
                match open(&name) {
                    Ok(file) => Sink::File { file, pid },
                    Err(e) => {
                        notes.push(format!(
                            "EP_LOG_FILE: cannot open {name:?} ({e}); logging to stderr"
                        ));
                        Sink::Stderr
                    }
                }
            }
        };
        let logger = Logger {
            level,
            host,
            pattern,
            sink: Mutex::new(sink),
        };
        for note in notes {
            logger.emit(&format_line(Level::Warn, None, &logger.host, pid, &note));
        }
        logger
    }

    fn emit(&self, line: &str) {
        let Ok(mut sink) = self.sink.lock() else {
            return;
        };
        let pid = std::process::id();
        // A forked child writes to a file of its own when the name has %p.
        if let (Sink::File { pid: opened, .. }, Some(p)) = (&*sink, &self.pattern) {
            if *opened != pid && p.contains("%p") {
                if let Ok(file) = open(&expand_file_name(p, &self.host, pid)) {
                    *sink = Sink::File { file, pid };
                }
            }
        }
        match &mut *sink {
            // One write per line, so lines of ranks in other processes that
            // append to the same file do not interleave.
            Sink::File { file, .. } => {
                let _ = file.write_all(line.as_bytes());
            }
            // eprint! (which a test harness captures) but never a panic
            // across the C boundary if stderr is gone.
            Sink::Stderr => {
                let _ = std::panic::catch_unwind(|| eprint!("{line}"));
            }
        }
    }
}

/// Whether statements of `level` are written.
#[inline]
pub fn enabled(level: Level) -> bool {
    level != Level::Off && level <= LOGGER.level
}

/// Writes one line at `level` (callers check [`enabled`] first; the macros
/// do).
pub fn write(level: Level, args: fmt::Arguments) {
    let who = WHO.with(|w| w.get());
    let line = format_line(
        level,
        who,
        &LOGGER.host,
        std::process::id(),
        &args.to_string(),
    );
    LOGGER.emit(&line);
}

/// Logs at `WARN`: failed calls and anything the user should act on.
macro_rules! warning {
    ($($arg:tt)*) => {
        if $crate::runtime::log::enabled($crate::runtime::log::Level::Warn) {
            $crate::runtime::log::write($crate::runtime::log::Level::Warn, format_args!($($arg)*))
        }
    };
}

/// Logs at `INFO`: what a context decided when it was made.
macro_rules! info {
    ($($arg:tt)*) => {
        if $crate::runtime::log::enabled($crate::runtime::log::Level::Info) {
            $crate::runtime::log::write($crate::runtime::log::Level::Info, format_args!($($arg)*))
        }
    };
}

/// Logs at `DEBUG`: one line per operation.
macro_rules! debug {
    ($($arg:tt)*) => {
        if $crate::runtime::log::enabled($crate::runtime::log::Level::Debug) {
            $crate::runtime::log::write($crate::runtime::log::Level::Debug, format_args!($($arg)*))
        }
    };
}

/// Logs at `TRACE`: every API call.
macro_rules! trace {
    ($($arg:tt)*) => {
        if $crate::runtime::log::enabled($crate::runtime::log::Level::Trace) {
            $crate::runtime::log::write($crate::runtime::log::Level::Trace, format_args!($($arg)*))
        }
    };
}

pub(crate) use {debug, info, trace, warning};

/// `bytes` for people: "1.50 GiB", "64.0 KiB", "512 B".
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_case_insensitively_and_order() {
        assert_eq!(Level::parse("warn"), Some(Level::Warn));
        assert_eq!(Level::parse(" INFO "), Some(Level::Info));
        assert_eq!(Level::parse("Debug"), Some(Level::Debug));
        assert_eq!(Level::parse("trace"), Some(Level::Trace));
        assert_eq!(Level::parse("off"), Some(Level::Off));
        assert_eq!(Level::parse("none"), Some(Level::Off));
        assert_eq!(Level::parse("verbose"), None);
        assert_eq!(Level::parse(""), None);
        assert!(Level::Warn < Level::Info && Level::Info < Level::Debug);
        assert!(Level::Debug < Level::Trace);
    }

    #[test]
    fn file_names_expand_host_pid_and_percent() {
        assert_eq!(
            expand_file_name("/tmp/ep.%h.%p.log", "node1", 42),
            "/tmp/ep.node1.42.log"
        );
        assert_eq!(expand_file_name("a%%p", "h", 7), "a%p");
        assert_eq!(expand_file_name("%x%", "h", 7), "%x%");
        assert_eq!(expand_file_name("plain.log", "h", 7), "plain.log");
        assert_eq!(expand_file_name("%p%p", "h", 7), "77");
    }

    #[test]
    fn lines_name_host_pid_rank_and_device() {
        let gpu = Who {
            rank: 1,
            world: 8,
            device: Some(3),
        };
        assert_eq!(
            format_line(Level::Info, Some(gpu), "node7", 4242, "hello"),
            "node7:4242 [rank 1/8 dev 3] EP INFO hello\n"
        );
        let host = Who {
            device: None,
            ..gpu
        };
        assert_eq!(
            format_line(Level::Debug, Some(host), "n", 1, "x"),
            "n:1 [rank 1/8 dev host] EP DEBUG x\n"
        );
        assert_eq!(
            format_line(Level::Warn, None, "n", 1, "y"),
            "n:1 [rank - dev -] EP WARN y\n"
        );
    }

    #[test]
    fn bytes_read_well() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(64 * 1024), "64.00 KiB");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
    }

    #[test]
    fn the_thread_context_is_set_cleared_and_restored() {
        let who = Who {
            rank: 0,
            world: 2,
            device: None,
        };
        restore(Some(who));
        let saved = leave();
        assert_eq!(saved, Some(who));
        assert_eq!(leave(), None);
        restore(saved);
        assert_eq!(leave(), Some(who));
    }
}
