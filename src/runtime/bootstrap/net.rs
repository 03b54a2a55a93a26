//! Sockets: choosing the root's address, waiting in short slices against a
//! deadline and an abort flag, non-blocking connect, send and receive.
//!
//! Every socket is close-on-exec, and every send and receive passes
//! MSG_DONTWAIT, so sockets need not be in non-blocking mode (listeners are).
//! Nothing ever blocks in the kernel for longer than [`SLICE`], so a deadline
//! or an abort is noticed within that time.

use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::seconds;
use crate::error::{Error, ErrorKind, Result};

/// The longest single wait in the kernel.
pub(super) const SLICE: Duration = Duration::from_millis(50);

/// Picks the address the root listens on (see the module doc of
/// `bootstrap` for the two variables). The values are passed in, rather than
/// read here, so tests need not touch the process environment.
pub(super) fn choose_root_address(
    forced: Option<&str>,
    ifname: Option<&str>,
) -> Result<SocketAddr> {
    if let Some(text) = forced {
        let addr = text
            .parse::<SocketAddr>()
            .or_else(|_| text.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 0)))
            .map_err(|_| {
                Error::invalid(format!(
                    "EP_SOCKET_ADDR={text:?} is neither an IP address nor IP:port"
                ))
            })?;
        if addr.ip().is_unspecified() {
            return Err(Error::invalid(format!(
                "EP_SOCKET_ADDR={text:?}: the root needs an address other ranks can reach, not a wildcard"
            )));
        }
        return Ok(addr);
    }
    let interfaces = interfaces()?;
    if let Some(name) = ifname {
        // Prefer the interface's IPv4 address; fall back to its IPv6 one.
        let mine = || interfaces.iter().filter(|i| i.name == name);
        return mine()
            .find(|i| i.addr.is_ipv4())
            .or_else(|| mine().next())
            .map(|i| i.addr)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "EP_SOCKET_IFNAME={name:?}: no such interface with an IP address"
                ))
            });
    }
    let first_up_ipv4 = interfaces
        .iter()
        .find(|i| i.up && !i.loopback && i.addr.is_ipv4());
    Ok(
        first_up_ipv4.map_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0), |i| {
            i.addr
        }),
    )
}

/// One address of one network interface, as getifaddrs(3) reports it.
struct Interface {
    name: String,
    up: bool,
    loopback: bool,
    /// Port 0; an IPv6 address keeps its scope id (needed for link-local).
    addr: SocketAddr,
}

fn interfaces() -> Result<Vec<Interface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs stores a list head in `head`, freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::last_os("getifaddrs"));
    }
    let mut found = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive
        // until freeifaddrs; its name is a NUL-terminated string and its
        // address, when not null, is a sockaddr of the family it names.
        unsafe {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            if ifa.ifa_addr.is_null() {
                continue;
            }
            let addr = match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                    SocketAddr::new(IpAddr::V4(ip), 0)
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                    SocketAddr::V6(SocketAddrV6::new(ip, 0, 0, sin6.sin6_scope_id))
                }
                _ => continue,
            };
            let flags = ifa.ifa_flags;
            found.push(Interface {
                name: CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned(),
                up: flags & libc::IFF_UP as u32 != 0,
                loopback: flags & libc::IFF_LOOPBACK as u32 != 0,
                addr,
            });
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(found)
}

/// When a blocking step must give up, and the flag that aborts it early.
#[derive(Clone, Copy)]
pub(super) struct Deadline<'a> {
    at: Instant,
    /// The configured timeout, for messages.
    timeout: Duration,
    abort: Option<&'a AtomicBool>,
}

impl<'a> Deadline<'a> {
    pub(super) fn new(timeout: Duration, abort: Option<&'a AtomicBool>) -> Self {
        Deadline {
            at: instant_after(timeout),
            timeout,
            abort,
        }
    }

    /// The same deadline moved `extra` later.
    pub(super) fn extended(self, extra: Duration) -> Self {
        Deadline {
            at: self.at.checked_add(extra).unwrap_or(self.at),
            ..self
        }
    }

    pub(super) fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// Waits at most `max` (and never past the deadline) for an event on
    /// `fds`; an empty `fds` just sleeps. Fails with Aborted once the flag is
    /// set and with Timeout once the deadline has passed; `what` describes
    /// the step for those messages.
    pub(super) fn wait(
        &self,
        fds: &mut [libc::pollfd],
        max: Duration,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        if self.abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
            return Err(Error::new(
                ErrorKind::Aborted,
                format!("{}: aborted", what()),
            ));
        }
        let left = self.remaining();
        if left.is_zero() {
            return Err(Error::timeout(format!(
                "{}: timed out after {}",
                what(),
                seconds(self.timeout)
            )));
        }
        poll(fds, left.min(max).min(SLICE))
    }
}

/// poll(2) for at most `max`; an interrupted poll counts as a quiet one.
pub(super) fn poll(fds: &mut [libc::pollfd], max: Duration) -> Result<()> {
    // Round up so a sub-millisecond wait still sleeps.
    let ms = max.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid, writable array of `fds.len()` pollfds.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(Error::system("poll", err));
        }
    }
    Ok(())
}

/// `now + d`, or a far future when that does not fit in an Instant.
pub(super) fn instant_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(10 * 365 * 24 * 3600))
}

pub(super) fn pollfd(fd: BorrowedFd, events: libc::c_short) -> libc::pollfd {
    pollfd_opt(Some(fd), events)
}

/// A poll entry for `fd`, or for `None` one that poll ignores (fd -1): a
/// listener that is not needed this round keeps its position in the array.
pub(super) fn pollfd_opt(fd: Option<BorrowedFd>, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd: fd.map_or(-1, |fd| fd.as_raw_fd()),
        events,
        revents: 0,
    }
}

/// How a send or receive over a connection ended early.
#[derive(Debug)]
pub(super) enum Fail {
    /// The far end closed or reset the connection.
    Closed,
    /// Timeout, abort or an OS error, already described.
    Other(Error),
}

impl Fail {
    /// Turns the failure into an error, `closed` describing a closed peer.
    pub(super) fn or_closed(self, closed: impl FnOnce() -> Error) -> Error {
        match self {
            Fail::Closed => closed(),
            Fail::Other(e) => e,
        }
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::Other(e)
    }
}

/// Whether an OS error means the peer went away.
fn is_closed(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::NotConnected
    )
}

/// One non-blocking send. `Ok(None)` means "would block"; MSG_NOSIGNAL keeps
/// a closed peer from raising SIGPIPE in a host program that did not ignore it.
pub(super) fn send_some(fd: BorrowedFd, buf: &[u8]) -> std::result::Result<Option<usize>, Fail> {
    loop {
        // SAFETY: the pointer and length describe `buf`.
        let n = unsafe {
            libc::send(
                fd.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let err = io::Error::last_os_error();
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ if is_closed(&err) => return Err(Fail::Closed),
            _ => return Err(Fail::Other(Error::system("send", err))),
        }
    }
}

/// One non-blocking receive. `Ok(None)` means "nothing yet"; a closed peer
/// (end of stream) is `Fail::Closed`.
pub(super) fn recv_some(
    fd: BorrowedFd,
    buf: &mut [u8],
) -> std::result::Result<Option<usize>, Fail> {
    if buf.is_empty() {
        return Ok(Some(0));
    }
    loop {
        // SAFETY: the pointer and length describe `buf`, writable.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n > 0 {
            return Ok(Some(n as usize));
        }
        if n == 0 {
            return Err(Fail::Closed);
        }
        let err = io::Error::last_os_error();
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ if is_closed(&err) => return Err(Fail::Closed),
            _ => return Err(Fail::Other(Error::system("recv", err))),
        }
    }
}

/// Sends all of `buf` before the deadline.
pub(super) fn send_all(
    fd: BorrowedFd,
    mut buf: &[u8],
    deadline: &Deadline,
    what: &dyn Fn() -> String,
) -> std::result::Result<(), Fail> {
    while !buf.is_empty() {
        match send_some(fd, buf)? {
            Some(n) => buf = &buf[n..],
            None => deadline.wait(&mut [pollfd(fd, libc::POLLOUT)], SLICE, what)?,
        }
    }
    Ok(())
}

/// Fills all of `buf` before the deadline.
pub(super) fn recv_exact(
    fd: BorrowedFd,
    buf: &mut [u8],
    deadline: &Deadline,
    what: &dyn Fn() -> String,
) -> std::result::Result<(), Fail> {
    let mut got = 0;
    while got < buf.len() {
        match recv_some(fd, &mut buf[got..])? {
            Some(n) => got += n,
            None => deadline.wait(&mut [pollfd(fd, libc::POLLIN)], SLICE, what)?,
        }
    }
    Ok(())
}

/// A socket address in the form connect(2) takes.
pub(super) struct RawAddr {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

impl RawAddr {
    pub(super) fn ip(addr: &SocketAddr) -> RawAddr {
        // SAFETY: all-zero bytes are a valid sockaddr_storage.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let len = match addr {
            SocketAddr::V4(a) => {
                // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
                let sin = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in) };
                sin.sin_family = libc::AF_INET as libc::sa_family_t;
                sin.sin_port = a.port().to_be();
                sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
                std::mem::size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(a) => {
                // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
                let sin6 = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in6) };
                sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sin6.sin6_port = a.port().to_be();
                sin6.sin6_flowinfo = a.flowinfo();
                sin6.sin6_addr.s6_addr = a.ip().octets();
                sin6.sin6_scope_id = a.scope_id();
                std::mem::size_of::<libc::sockaddr_in6>()
            }
        };
        RawAddr {
            storage,
            len: len as libc::socklen_t,
        }
    }

    /// An address in Linux's abstract Unix namespace (no file on disk; it
    /// disappears with the listening socket).
    pub(super) fn abstract_unix(name: &[u8]) -> RawAddr {
        // SAFETY: all-zero bytes are a valid sockaddr_storage.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_un.
        let sun = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_un) };
        sun.sun_family = libc::AF_UNIX as libc::sa_family_t;
        // sun_path[0] stays 0: that marks the abstract namespace. Our names
        // are far shorter than the room left; a longer one would be cut.
        let room = sun.sun_path.len() - 1;
        let name = &name[..name.len().min(room)];
        for (dst, &src) in sun.sun_path[1..].iter_mut().zip(name) {
            *dst = src as libc::c_char;
        }
        let path_at = std::mem::size_of::<libc::sa_family_t>();
        RawAddr {
            storage,
            len: (path_at + 1 + name.len()) as libc::socklen_t,
        }
    }

    fn family(&self) -> libc::c_int {
        libc::c_int::from(self.storage.ss_family)
    }
}

/// Connects to `addr`, retrying while nobody listens yet (refused) or the
/// listener's queue is full, until the deadline. `what` names the step.
pub(super) fn connect_retrying(
    addr: &RawAddr,
    deadline: &Deadline,
    what: &dyn Fn() -> String,
) -> Result<OwnedFd> {
    let mut pause = Duration::from_millis(2);
    loop {
        match connect_once(addr, deadline, what)? {
            Ok(fd) => return Ok(fd),
            Err(err) if retryable(&err) => {
                deadline.wait(&mut [], pause, what)?;
                pause = (pause * 2).min(SLICE);
            }
            Err(err) => return Err(Error::system(&what(), err)),
        }
    }
}

fn retryable(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(
            libc::ECONNREFUSED
                | libc::ECONNRESET
                | libc::ETIMEDOUT
                | libc::EAGAIN
                | libc::ENETUNREACH
                | libc::EHOSTUNREACH
        )
    )
}

/// One connect attempt. The outer Result is a timeout, abort or a failure to
/// create the socket; the inner one is the attempt's outcome.
fn connect_once(
    addr: &RawAddr,
    deadline: &Deadline,
    what: &dyn Fn() -> String,
) -> Result<io::Result<OwnedFd>> {
    let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: plain socket(2) call.
    let raw = unsafe { libc::socket(addr.family(), kind, 0) };
    if raw < 0 {
        return Err(Error::last_os("socket"));
    }
    // SAFETY: `raw` is a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: `addr.storage` holds a sockaddr of `addr.len` bytes.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &addr.storage as *const _ as *const libc::sockaddr,
            addr.len,
        )
    };
    if rc == 0 {
        return Ok(Ok(fd));
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EINPROGRESS) {
        return Ok(Err(err));
    }
    // A TCP connect in progress: writable means finished, SO_ERROR says how.
    loop {
        let mut fds = [pollfd(fd.as_fd(), libc::POLLOUT)];
        deadline.wait(&mut fds, SLICE, what)?;
        if fds[0].revents != 0 {
            break;
        }
    }
    let mut so_error: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: SO_ERROR writes one c_int into `so_error`, whose size is `len`.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            &mut so_error as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    if rc != 0 {
        return Ok(Err(io::Error::last_os_error()));
    }
    if so_error != 0 {
        return Ok(Err(io::Error::from_raw_os_error(so_error)));
    }
    Ok(Ok(fd))
}

/// An accepted connection whose opening bytes are still arriving. Reading is
/// incremental, so one silent or slow client never holds up the others.
pub(super) struct Incoming {
    pub fd: OwnedFd,
    /// Received bytes; the first `got` are valid.
    pub buf: Vec<u8>,
    got: usize,
    /// When this connection is dropped if still incomplete.
    pub deadline: Instant,
}

/// What [`Incoming::fill`] found.
pub(super) enum Fill {
    /// Not all bytes asked for have arrived.
    More,
    /// `buf` is complete.
    Full,
    /// The client closed, reset or failed: drop it.
    Gone,
}

impl Incoming {
    /// Starts reading the first `want` bytes of `fd`.
    pub(super) fn new(fd: OwnedFd, want: usize, patience: Duration) -> Incoming {
        Incoming {
            fd,
            buf: vec![0; want],
            got: 0,
            deadline: instant_after(patience),
        }
    }

    /// Asks for `more` bytes beyond those requested so far. Callers bound
    /// `more` before calling.
    pub(super) fn expect(&mut self, more: usize) {
        self.buf.resize(self.buf.len() + more, 0);
    }

    /// Reads what has arrived, without blocking.
    pub(super) fn fill(&mut self) -> Fill {
        match recv_some(self.fd.as_fd(), &mut self.buf[self.got..]) {
            Ok(n) => {
                self.got += n.unwrap_or(0);
                if self.got == self.buf.len() {
                    Fill::Full
                } else {
                    Fill::More
                }
            }
            Err(_) => Fill::Gone,
        }
    }
}
