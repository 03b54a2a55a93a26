//! What every exported function does on entry and exit: catch panics, turn
//! errors into status codes, keep the thread's last error message, and read
//! the caller's versioned structs safely.

use super::context_api::ep_get_error_string;
use super::types::*;
use crate::error::{Error, ErrorKind, Result};
use crate::runtime::log;
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

thread_local! {
    /// Message of the last failed call on this thread ("" before any failure).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// The status code the C API reports for an error kind.
pub(crate) fn status_of(kind: ErrorKind) -> ep_status_t {
    match kind {
        ErrorKind::InvalidArgument => EP_ERR_INVALID_ARGUMENT,
        ErrorKind::NullPointer => EP_ERR_NULL_POINTER,
        ErrorKind::Unsupported => EP_ERR_UNSUPPORTED,
        ErrorKind::OutOfMemory => EP_ERR_OUT_OF_MEMORY,
        ErrorKind::CudaUnavailable => EP_ERR_CUDA_UNAVAILABLE,
        ErrorKind::Cuda => EP_ERR_CUDA,
        ErrorKind::Timeout => EP_ERR_TIMEOUT,
        ErrorKind::InProgress => EP_IN_PROGRESS,
        ErrorKind::Aborted => EP_ERR_ABORTED,
        ErrorKind::Internal => EP_ERR_INTERNAL,
        ErrorKind::System => EP_ERR_SYSTEM,
        ErrorKind::Remote => EP_ERR_REMOTE,
    }
}

fn set_last_error(function: &str, message: &str) {
    // An interior NUL would truncate the C string: replace it.
    let text = format!("{function}: {message}").replace('\0', " ");
    let text = CString::new(text).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = text);
}

/// Pointer to the thread's last error message; valid until the next failing
/// call on this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}

thread_local! {
    /// How many `run`s are active on this thread (an entry point that calls
    /// another's body nests them); only the outermost one logs.
    static DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs the body of exported function `function`: a panic becomes
/// `EP_ERR_INTERNAL`, an error its status code; both leave a message, which
/// also goes to the log (`EP_LOG_LEVEL` warn and up). The body names its
/// context for the log's line prefix with `log::enter`.
pub(crate) fn run(function: &str, body: impl FnOnce() -> Result<()>) -> ep_status_t {
    let outer = DEPTH.with(|d| d.replace(d.get() + 1)) == 0;
    let saved = log::leave();
    let start = (outer && log::enabled(log::Level::Trace)).then(Instant::now);
    let status = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => EP_SUCCESS,
        Ok(Err(err)) => {
            set_last_error(function, &err.message);
            status_of(err.kind)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            set_last_error(function, &format!("internal error (panic): {what}"));
            EP_ERR_INTERNAL
        }
    };
    if outer {
        log_outcome(function, status, start);
    }
    log::restore(saved);
    DEPTH.with(|d| d.set(d.get() - 1));
    status
}

/// The log lines of a finished call: a failure at WARN with the thread's
/// last-error text, and at TRACE every call with its time.
fn log_outcome(function: &str, status: ep_status_t, start: Option<Instant>) {
    // SAFETY: a static NUL-terminated string.
    let name = unsafe { CStr::from_ptr(ep_get_error_string(status)) }.to_string_lossy();
    if status != EP_SUCCESS {
        LAST_ERROR.with(|last| {
            log::warning!(
                "{function} failed: {name} ({status}): {}",
                last.borrow().to_string_lossy()
            )
        });
    }
    if let Some(start) = start {
        log::trace!(
            "{function} -> {name} in {:.1} us",
            start.elapsed().as_secs_f64() * 1e6
        );
    }
}

/// Borrows a required pointer argument.
///
/// # Safety
/// `ptr` must be NULL or point to a live `T`.
pub(crate) unsafe fn deref<'a, T>(ptr: *const T, name: &str) -> Result<&'a T> {
    ptr.as_ref().ok_or_else(|| Error::null(name))
}

/// Writes an output argument, after checking it is not NULL.
///
/// # Safety
/// `ptr` must be NULL or point to writable memory for a `T`.
pub(crate) unsafe fn write_out<T>(ptr: *mut T, name: &str, value: T) -> Result<()> {
    if ptr.is_null() {
        return Err(Error::null(name));
    }
    ptr.write(value);
    Ok(())
}

/// A struct that starts with the `struct_size`, `magic`, `version` header.
pub(crate) trait Versioned: Copy {
    const NAME: &'static str;
    const MAGIC: u32;
    const MIN_SIZE: u32;
    /// The defaults, header filled in, as the struct's `ep_*_init` writes them.
    fn defaults() -> Self;
}

/// Reads a caller's versioned struct: checks its header, then copies only the
/// `struct_size` bytes the caller has, over the defaults, so that an older,
/// smaller struct gets defaults for the fields it lacks.
///
/// # Safety
/// `ptr` must be NULL or point to at least `struct_size` readable bytes, where
/// `struct_size` is the value in its first four bytes.
pub(crate) unsafe fn read_versioned<T: Versioned>(ptr: *const T) -> Result<T> {
    if ptr.is_null() {
        return Err(Error::null(T::NAME));
    }
    let header = ptr as *const u32;
    let (size, magic, version) = (
        header.read_unaligned(),
        header.add(1).read_unaligned(),
        header.add(2).read_unaligned(),
    );
    if magic != T::MAGIC {
        return Err(Error::invalid(format!(
            "{}: bad magic 0x{magic:08x} (expected 0x{:08x}); initialise it with its ep_*_init function",
            T::NAME,
            T::MAGIC
        )));
    }
    let current = std::mem::size_of::<T>() as u32;
    if size < T::MIN_SIZE || size > current {
        return Err(Error::invalid(format!(
            "{}: struct_size {size} is outside [{}, {current}] (a struct from another ep release?)",
            T::NAME,
            T::MIN_SIZE
        )));
    }
    if version == 0 {
        return Err(Error::invalid(format!("{}: version is 0", T::NAME)));
    }
    let mut value = T::defaults();
    std::ptr::copy_nonoverlapping(
        ptr as *const u8,
        &mut value as *mut T as *mut u8,
        size as usize,
    );
    Ok(value)
}

/// Fills a caller's struct with its defaults (`ep_*_init`).
///
/// # Safety
/// `ptr` must be NULL or point to a writable `T`.
pub(crate) unsafe fn init_versioned<T: Versioned>(ptr: *mut T) -> Result<()> {
    write_out(ptr, T::NAME, T::defaults())
}

/// Checks the header of a versioned struct embedded by value in another one:
/// it has the current size, as the outer struct's layout depends on it.
pub(crate) fn check_embedded<T: Versioned>(value: &T) -> Result<()> {
    let header = value as *const T as *const u32;
    // SAFETY: every versioned struct starts with three u32 fields.
    let (size, magic) = unsafe { (header.read(), header.add(1).read()) };
    let expected = std::mem::size_of::<T>() as u32;
    if magic != T::MAGIC || size != expected {
        return Err(Error::invalid(format!(
            "embedded {}: magic 0x{magic:08x} and struct_size {size} (expected 0x{:08x} and {expected}); initialise it with its ep_*_init function",
            T::NAME,
            T::MAGIC
        )));
    }
    Ok(())
}
