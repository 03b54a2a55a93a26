//! Passing file descriptors to ranks on the same host: SCM_RIGHTS ancillary
//! data on the mesh's Unix stream sockets. The kernel installs a duplicate
//! of the sender's descriptor in the receiving process.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::collective::{check_header, header, Op, HEADER_BYTES};
use super::net::{pollfd, send_all, Deadline, Fail, SLICE};
use super::{disconnected, Bootstrap};
use crate::error::{Error, Result};

/// Room for the control message of a few descriptors, aligned for cmsghdr.
/// Only one is expected; the spare room lets extra ones be received (and
/// closed) rather than leaked by truncation.
#[repr(C, align(8))]
struct ControlBuf([u8; 64]);

impl Bootstrap {
    /// The body of `all_gather_fds`: sends `fd` to every other local rank
    /// and receives theirs; `own` (a dup of `fd`) fills this rank's entry.
    pub(super) fn exchange_fds(
        &self,
        fd: BorrowedFd,
        own: OwnedFd,
        deadline: &Deadline,
    ) -> Result<Vec<Option<OwnedFd>>> {
        let (me, seq) = (self.rank, self.next_seq());
        let head = header(Op::AllGatherFds, seq, 0);
        let peers: Vec<usize> = self.local.iter().copied().filter(|&r| r != me).collect();
        let link = |peer: usize| {
            self.unix[peer].as_ref().map(|s| s.as_fd()).ok_or_else(|| {
                Error::internal(format!("rank {me} has no Unix link to rank {peer}"))
            })
        };

        // Send to all, then receive from all. Each message is 12 bytes and
        // every call reads everything the previous one sent, so the sends
        // always fit in the socket buffers and never wait on receives.
        for &peer in &peers {
            let what = || format!("all_gather_fds #{seq} on rank {me}: sending to rank {peer}");
            send_with_fd(link(peer)?, &head, fd, deadline, &what)
                .map_err(|f| f.or_closed(disconnected(peer)))?;
        }
        let mut all: Vec<Option<OwnedFd>> = (0..self.world).map(|_| None).collect();
        for &peer in &peers {
            let what = || format!("all_gather_fds #{seq} on rank {me}: waiting for rank {peer}");
            let mut got = [0u8; HEADER_BYTES];
            let mut fds = recv_with_fds(link(peer)?, &mut got, deadline, &what)
                .map_err(|f| f.or_closed(disconnected(peer)))?;
            check_header(&got, Op::AllGatherFds, seq, 0, peer)?;
            if fds.len() != 1 {
                return Err(Error::remote(format!(
                    "rank {peer} sent {} file descriptors in all_gather_fds, expected 1",
                    fds.len()
                )));
            }
            all[peer] = fds.pop();
        }
        all[me] = Some(own);
        Ok(all)
    }
}

/// Sends `msg` (not empty) with `fd` attached to its first byte.
fn send_with_fd(
    sock: BorrowedFd,
    msg: &[u8],
    fd: BorrowedFd,
    deadline: &Deadline,
    what: &dyn Fn() -> String,
) -> std::result::Result<(), Fail> {
    let mut control = ControlBuf([0; 64]);
    let raw = fd.as_raw_fd();
    loop {
        let mut iov = libc::iovec {
            iov_base: msg.as_ptr() as *mut libc::c_void,
            iov_len: msg.len(),
        };
        // SAFETY: an all-zero msghdr is valid; the fields set below point at
        // `iov` and `control`, which outlive the sendmsg call. CMSG_FIRSTHDR
        // is non-null because the control buffer holds one header, and
        // CMSG_DATA has room for one c_int (CMSG_SPACE(4) <= 64).
        let sent = unsafe {
            let mut hdr: libc::msghdr = std::mem::zeroed();
            hdr.msg_iov = &mut iov;
            hdr.msg_iovlen = 1;
            hdr.msg_control = control.0.as_mut_ptr().cast();
            hdr.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) as _;
            let cmsg = libc::CMSG_FIRSTHDR(&hdr);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut libc::c_int, raw);
            libc::sendmsg(
                sock.as_raw_fd(),
                &hdr,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if sent >= 0 {
            // The descriptor went with the first byte; any rest is plain data.
            return send_all(sock, &msg[sent as usize..], deadline, what);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EAGAIN) => deadline.wait(&mut [pollfd(sock, libc::POLLOUT)], SLICE, what)?,
            Some(libc::EPIPE | libc::ECONNRESET) => return Err(Fail::Closed),
            _ => return Err(Fail::Other(Error::system("sendmsg", err))),
        }
    }
}

/// Fills `buf` and returns every descriptor that arrived with those bytes
/// (the caller checks how many it expected). Received descriptors are
/// close-on-exec.
fn recv_with_fds(
    sock: BorrowedFd,
    buf: &mut [u8],
    deadline: &Deadline,
    what: &dyn Fn() -> String,
) -> std::result::Result<Vec<OwnedFd>, Fail> {
    let mut fds = Vec::new();
    let mut got = 0;
    while got < buf.len() {
        let mut control = ControlBuf([0; 64]);
        let mut iov = libc::iovec {
            iov_base: buf[got..].as_mut_ptr().cast(),
            iov_len: buf.len() - got,
        };
        // SAFETY: an all-zero msghdr is valid; it points at `iov` (into
        // `buf`, writable) and `control`, both alive during the call.
        let (n, hdr) = unsafe {
            let mut hdr: libc::msghdr = std::mem::zeroed();
            hdr.msg_iov = &mut iov;
            hdr.msg_iovlen = 1;
            hdr.msg_control = control.0.as_mut_ptr().cast();
            hdr.msg_controllen = control.0.len() as _;
            let flags = libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC;
            (libc::recvmsg(sock.as_raw_fd(), &mut hdr, flags), hdr)
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::EAGAIN) => {
                    deadline.wait(&mut [pollfd(sock, libc::POLLIN)], SLICE, what)?
                }
                Some(libc::ECONNRESET) => return Err(Fail::Closed),
                _ => return Err(Fail::Other(Error::system("recvmsg", err))),
            }
            continue;
        }
        // Take ownership of what arrived before anything else, so that every
        // descriptor is closed if we fail below.
        // SAFETY: the kernel filled `hdr.msg_controllen` bytes of `control`
        // with well-formed cmsghdrs, which the CMSG macros walk; an
        // SCM_RIGHTS payload is an array of freshly installed descriptors
        // that nobody else owns.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&hdr);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg) as *const libc::c_int;
                    let bytes =
                        ((*cmsg).cmsg_len as usize).saturating_sub(data as usize - cmsg as usize);
                    for k in 0..bytes / std::mem::size_of::<libc::c_int>() {
                        let raw = std::ptr::read_unaligned(data.add(k));
                        fds.push(OwnedFd::from_raw_fd(raw));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&hdr, cmsg);
            }
        }
        if hdr.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(Fail::Other(Error::remote(
                "received more file descriptors than expected (some were dropped)",
            )));
        }
        if n == 0 {
            return Err(Fail::Closed);
        }
        got += n as usize;
    }
    Ok(fds)
}
