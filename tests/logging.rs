//! The log (`EP_LOG_LEVEL`, `EP_LOG_FILE`) on the host backend: the summary
//! a context writes at `info`, the per-call lines at `debug`, a failed call's
//! line with its last-error text at the default level, the file name's `%h`
//! and `%p`, and a bad level named in a warning. ep-bench runs the host
//! backend in child processes (the log reads the environment once per
//! process); the failed call runs in this process.

mod common;

use common::last_error;
use common::tools::fresh_dir;
use ep::capi::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch(name: &str) -> PathBuf {
    fresh_dir(std::env::temp_dir().join(format!("ep-logging-{}-{name}", std::process::id())))
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: writes at most buf.len() bytes.
    assert_eq!(
        unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) },
        0
    );
    let len = buf.iter().position(|&b| b == 0).unwrap();
    String::from_utf8_lossy(&buf[..len]).into_owned()
}

/// ep-bench, host backend, 2 ranks, a tiny normal-mode run, with `env`.
fn bench(env: &[(&str, &Path)], level: &str) -> (Output, u32) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ep-bench"));
    cmd.args(["--backend", "host", "--ranks", "2", "--hidden", "256"])
        .args(["--experts", "8", "--topk", "2", "--tokens", "4"])
        .args(["--iters", "1", "--warmup", "0", "--mode", "normal"])
        .env("EP_LOG_LEVEL", level)
        .env_remove("EP_LOG_FILE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = child.spawn().expect("ep-bench starts");
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "ep-bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (out, pid)
}

#[test]
fn info_writes_each_ranks_summary_to_the_named_file() {
    let dir = scratch("info");
    let pattern = dir.join("ep-%h-%p.log");
    let (out, pid) = bench(&[("EP_LOG_FILE", &pattern)], "info");
    let file = dir.join(format!("ep-{}-{pid}.log", host_name()));
    let log = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("no log file {}: {e}", file.display()));
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains(" EP "),
        "with EP_LOG_FILE nothing goes to stderr"
    );
    let prefix = format!("{}:{pid} ", host_name());
    for rank in 0..2 {
        let mine: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(&format!("[rank {rank}/2 dev host] EP INFO ")))
            .collect();
        for want in [
            "ep 0.1.0 (API 100), backend host (config), rank",
            "config: max_tokens_per_rank 4 (set), hidden 256 (set), topk 2 (set), num_experts 8 (set), token_dtype BF16 (default)",
            "bootstrap: 2 ranks on 1 host(s); ranks on this host: [0, 1]",
            "host backend: shared buffer ",
            "context ready in ",
        ] {
            assert!(
                mine.iter().any(|l| l.contains(want)),
                "rank {rank}: no line with {want:?} in\n{log}"
            );
        }
    }
    assert!(log.lines().all(|l| l.starts_with(&prefix)), "{log}");
    assert!(
        !log.contains(" EP DEBUG "),
        "no debug lines at info:\n{log}"
    );
}

#[test]
fn debug_adds_a_line_per_call_with_its_shape_and_path() {
    let (out, _) = bench(&[], "debug");
    let err = String::from_utf8_lossy(&out.stderr);
    for rank in 0..2 {
        let who = format!("[rank {rank}/2 dev host] EP DEBUG ");
        for want in [
            "ep_get_dispatch_layout: 4 tokens",
            "ep_dispatch: 4 tokens BF16 -> source-order (8 rows); host-synchronised",
            "ep_dispatch: 4 tokens FP8 -> source-order (8 rows)",
            "ep_dispatch: 4 tokens BF16 -> expert-major (",
            "ep_combine: expert-major input",
            "ep_combine: source-order input",
        ] {
            assert!(
                err.lines().any(|l| l.contains(&who) && l.contains(want)),
                "rank {rank}: no debug line with {want:?} in\n{err}"
            );
        }
    }
    assert!(!err.contains(" EP TRACE "), "{err}");
}

#[test]
fn an_unknown_level_is_named_and_warn_is_used() {
    let (out, _) = bench(&[], "loud");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "EP WARN EP_LOG_LEVEL=\"loud\" is not off, warn, info, debug or trace; using warn"
        ),
        "{err}"
    );
    assert!(!err.contains(" EP INFO "), "{err}");
}

/// The only test of this binary that calls the library in-process: the log
/// is configured from the environment at its first use.
#[test]
fn a_failed_call_is_logged_with_its_last_error_at_the_default_level() {
    let dir = scratch("warn");
    std::env::set_var("EP_LOG_FILE", dir.join("ep.%p.log"));
    std::env::remove_var("EP_LOG_LEVEL");
    // SAFETY: valid pointers; the config is refused before anything starts.
    let (status, message) = unsafe {
        let mut cfg = std::mem::zeroed();
        assert_eq!(ep_config_init(&mut cfg), EP_SUCCESS);
        cfg.hidden = 100;
        cfg.backend = EP_BACKEND_HOST;
        let id = ep_unique_id_t {
            internal: [0; EP_UNIQUE_ID_BYTES],
        };
        let mut ctx = std::ptr::null_mut();
        let status = ep_ctx_create(&mut ctx, 2, id, 0, 0, &cfg);
        (status, last_error())
    };
    assert_eq!(status, EP_ERR_INVALID_ARGUMENT);
    let file = dir.join(format!("ep.{}.log", std::process::id()));
    let log = std::fs::read_to_string(&file).expect("the log file");
    let want =
        format!("[rank - dev -] EP WARN ep_ctx_create failed: invalid argument (1): {message}");
    assert!(
        log.lines().any(|l| l.ends_with(&want)),
        "no line ending in {want:?} in\n{log}"
    );
    assert!(message.contains("hidden = 100"), "{message}");
}
