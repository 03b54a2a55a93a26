//! The runtime's error type. The C boundary maps each [`ErrorKind`] to one
//! `EP_ERR_*` status code and keeps the message as the thread's last error.

use std::fmt;

/// What went wrong, in the categories the C API reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidArgument,
    NullPointer,
    Unsupported,
    OutOfMemory,
    CudaUnavailable,
    Cuda,
    Timeout,
    InProgress,
    Aborted,
    Internal,
    /// An operating-system call (socket, mmap, memfd) failed.
    System,
    /// A peer rank refused, misbehaved or disappeared.
    Remote,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }
    pub fn null(name: &str) -> Self {
        Self::new(ErrorKind::NullPointer, format!("`{name}` is NULL"))
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Timeout, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
    pub fn remote(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Remote, message)
    }
    /// An OS error: `what` failed with `err`.
    pub fn system(what: &str, err: std::io::Error) -> Self {
        Self::new(ErrorKind::System, format!("{what}: {err}"))
    }
    /// The last OS error (`errno`) for a libc call that just failed.
    pub fn last_os(what: &str) -> Self {
        Self::system(what, std::io::Error::last_os_error())
    }
    /// Prefixes the message with where it happened.
    pub fn context(mut self, what: &str) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

impl std::error::Error for Error {}
