//! Shared memory for the host backend: one memfd per rank, sent to the other
//! ranks of the host through the bootstrap's Unix channel and mapped by all.

use crate::error::{Error, Result};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

/// A `MAP_SHARED` mapping, unmapped on drop.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// The mapping is plain memory; the backend orders every access to it with
// the bootstrap's barriers.
unsafe impl Send for Mapping {}

impl Mapping {
    /// A new zero-filled memfd of `len` bytes. Pages are only backed once
    /// written, so a large worst-case size costs little.
    pub fn create_memfd(name: &str, len: usize) -> Result<OwnedFd> {
        let cname = std::ffi::CString::new(name).map_err(|_| Error::internal("memfd name"))?;
        // SAFETY: a valid C string and flags.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(Error::last_os("memfd_create"));
        }
        // SAFETY: `raw` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a valid descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::last_os("ftruncate of the shared buffer"));
        }
        Ok(fd)
    }

    /// Maps `len` bytes of a memfd (this rank's or a peer's).
    pub fn map(fd: &impl AsFd, len: usize) -> Result<Mapping> {
        // SAFETY: mapping a descriptor we were given, at a kernel-chosen address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::last_os("mmap of a shared buffer"));
        }
        Ok(Mapping {
            ptr: ptr as *mut u8,
            len,
        })
    }

    pub fn base(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len.max(1)) };
    }
}
