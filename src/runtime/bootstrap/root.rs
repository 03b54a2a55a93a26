//! The rendezvous root: a background thread that collects every rank's hello
//! and answers all of them at once, with the table of ranks or with the
//! reason the group cannot form. Then it exits.
//!
//! It also exits early, telling the ranks that joined why, when
//! [`stop`] is called for it: a rank of this process whose `ep_ctx_create`
//! failed before it could join means the group can never form, so the root
//! releases its thread and port at once rather than after its timeout.
//!
//! The thread serves one group and trusts nothing it receives: a connection
//! must open with the secret and a hello of the exact size, within
//! [`HANDSHAKE_TIMEOUT`], or it is closed without a word. Connections are
//! read incrementally in one poll loop, so a silent client holds up nobody.

use std::net::TcpListener;
use std::ops::ControlFlow;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use super::net::{
    instant_after, poll, pollfd, pollfd_opt, send_all, Deadline, Fill, Incoming, SLICE,
};
use super::wire::{framed, same_secret, Hello, Member, Reader, Verdict, HELLO_BYTES, SECRET_BYTES};
use super::{describe_ranks, seconds, HANDSHAKE_TIMEOUT, MAX_WORLD};
use crate::error::{Error, ErrorKind, Result};

/// The root gives up when nobody at all has joined for this long, so an id
/// that is never used does not keep a thread (and a port) forever.
const IDLE_LIMIT: Duration = Duration::from_secs(600);

/// Upper bound on connections still sending their opening bytes; beyond it
/// the root stops accepting until some finish or time out.
const MAX_PENDING: usize = 1024;

/// Time the root spends writing its final replies, for all ranks together.
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// The opening of every connection to the root: the secret and the hello's
/// length (u32), then the hello.
const OPENING_BYTES: usize = SECRET_BYTES + 4;

/// A request to stop a root early: the reason its ranks are told, once
/// given (the first reason stays).
type StopRequest = OnceLock<String>;

/// The roots this process runs, by session id. An entry dies with its root
/// thread (which holds the only strong reference).
static ROOTS: Mutex<Vec<(u64, Weak<StopRequest>)>> = Mutex::new(Vec::new());

/// Stops the root of group `session`, if this process runs it and it has
/// not finished: the ranks that joined are refused with `reason`
/// (`EP_ERR_REMOTE`).
pub(super) fn stop(session: u64, reason: String) {
    let roots = ROOTS.lock().unwrap_or_else(PoisonError::into_inner);
    let found = roots
        .iter()
        .find(|(s, _)| *s == session)
        .and_then(|(_, request)| request.upgrade());
    if let Some(request) = found {
        // A root asked to stop twice keeps the first reason.
        let _ = request.set(reason);
    }
}

/// Starts the root thread for group `session`.
pub(super) fn spawn(listener: TcpListener, secret: [u8; SECRET_BYTES], session: u64) -> Result<()> {
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::system("making the rendezvous listener non-blocking", e))?;
    let stop_request = Arc::new(StopRequest::default());
    {
        let mut roots = ROOTS.lock().unwrap_or_else(PoisonError::into_inner);
        roots.retain(|(_, r)| r.strong_count() > 0);
        roots.push((session, Arc::downgrade(&stop_request)));
    }
    let root = Root {
        listener,
        secret,
        pending: Vec::new(),
        group: None,
        stop_request,
    };
    std::thread::Builder::new()
        .name("ep-bootstrap-root".into())
        .spawn(move || root.run())
        .map_err(|e| Error::system("starting the rendezvous root thread", e))?;
    Ok(())
}

struct Root {
    listener: TcpListener,
    secret: [u8; SECRET_BYTES],
    /// Accepted connections whose opening has not fully arrived.
    pending: Vec<Incoming>,
    /// Formed by the first valid hello.
    group: Option<Group>,
    stop_request: Arc<StopRequest>,
}

struct Group {
    world: usize,
    /// The first rank to arrive, named when another disagrees on the world.
    first_rank: usize,
    /// The first arrival's timeout, and when it runs out.
    timeout: Duration,
    deadline: Instant,
    /// Index = rank: the hello and the connection the reply goes to.
    members: Vec<Option<(Hello, OwnedFd)>>,
    joined: usize,
}

impl Root {
    fn run(mut self) {
        let idle_until = Instant::now() + IDLE_LIMIT;
        loop {
            if let Some(reason) = self.stop_request.get().cloned() {
                return self.refuse_all(ErrorKind::Remote, reason);
            }
            let now = Instant::now();
            match &self.group {
                None if now >= idle_until => return,
                Some(group) if now >= group.deadline => return self.refuse_missing(),
                _ => {}
            }
            self.pending.retain(|p| p.deadline > now);

            // Entry 0 is the listener, left out while the pending list is full.
            let accepting = self.pending.len() < MAX_PENDING;
            let listener = accepting.then(|| self.listener.as_fd());
            let mut fds = vec![pollfd_opt(listener, libc::POLLIN)];
            fds.extend(
                self.pending
                    .iter()
                    .map(|p| pollfd(p.fd.as_fd(), libc::POLLIN)),
            );
            if poll(&mut fds, SLICE).is_err() {
                // Only a lack of kernel memory makes poll fail here; pause
                // rather than spin, and try again.
                std::thread::sleep(SLICE);
                continue;
            }

            // Walk backwards so swap_remove leaves earlier indices alone.
            for i in (0..self.pending.len()).rev() {
                if fds[i + 1].revents == 0 {
                    continue;
                }
                if let Some(hello) = self.read_opening(i) {
                    let fd = self.pending.swap_remove(i).fd;
                    if self.admit(hello, fd).is_break() {
                        return;
                    }
                }
            }
            if fds[0].revents != 0 {
                self.accept_all();
            }
        }
    }

    fn accept_all(&mut self) {
        while self.pending.len() < MAX_PENDING {
            match self.listener.accept() {
                Ok((stream, _)) => self.pending.push(Incoming::new(
                    stream.into(),
                    OPENING_BYTES,
                    HANDSHAKE_TIMEOUT,
                )),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                // Out of file descriptors, say: pause rather than spin, as
                // the listener stays readable; the next round retries.
                Err(_) => return std::thread::sleep(SLICE),
            }
        }
    }

    /// Reads what pending connection `i` has sent. Returns its hello once
    /// complete; drops the connection when it turns out to be no rank of
    /// ours (wrong secret, wrong length, malformed hello, closed).
    fn read_opening(&mut self, i: usize) -> Option<Hello> {
        let conn = &mut self.pending[i];
        let keep = match conn.fill() {
            Fill::More => return None,
            Fill::Gone => false,
            // Stage one: the secret and the hello's length, checked before
            // anything is allocated for the hello.
            Fill::Full if conn.buf.len() == OPENING_BYTES => {
                let (secret, len) = conn.buf.split_at(SECRET_BYTES);
                let len = Reader::new(len).u32().map(|n| n as usize);
                let ok = same_secret(secret, &self.secret) && len == Some(HELLO_BYTES);
                if ok {
                    conn.expect(HELLO_BYTES);
                }
                ok
            }
            // Stage two: the hello.
            Fill::Full => match Hello::decode(&conn.buf[OPENING_BYTES..]) {
                Some(hello) => return Some(hello),
                None => false,
            },
        };
        if !keep {
            self.pending.swap_remove(i);
        }
        None
    }

    /// Takes in one rank. Breaks when the root's work is over: everyone has
    /// the table, or everyone has been told why there is none.
    fn admit(&mut self, hello: Hello, fd: OwnedFd) -> ControlFlow<()> {
        let (rank, world) = (hello.rank, hello.world);
        if world == 0 || world > MAX_WORLD || rank >= world {
            // Only a misbehaving client gets here (ranks check their own
            // arguments), so it alone is told and the group goes on.
            let message = format!("rank {rank} is out of range for a world of {world}");
            tell_all(&refused(ErrorKind::InvalidArgument, message), [fd]);
            return ControlFlow::Continue(());
        }
        let group = self.group.get_or_insert_with(|| Group {
            world,
            first_rank: rank,
            timeout: hello.timeout,
            deadline: instant_after(hello.timeout),
            members: (0..world).map(|_| None).collect(),
            joined: 0,
        });

        let conflict = if world != group.world {
            Some(format!(
                "world size disagreement: rank {} says {}, rank {rank} says {world}",
                group.first_rank, group.world
            ))
        } else if group.members[rank].is_some() {
            Some(format!("rank {rank} claimed twice"))
        } else {
            None
        };
        if let Some(message) = conflict {
            let verdict = refused(ErrorKind::InvalidArgument, message);
            let members = group.members.drain(..).flatten().map(|(_, fd)| fd);
            tell_all(&verdict, members.chain([fd]));
            return ControlFlow::Break(());
        }

        group.members[rank] = Some((hello, fd));
        group.joined += 1;
        if group.joined < group.world {
            return ControlFlow::Continue(());
        }
        let members = std::mem::take(&mut group.members);
        let table = members
            .iter()
            .flatten()
            .map(|(h, _)| Member {
                host_id: h.host_id,
                listen: h.listen,
            })
            .collect();
        tell_all(
            &Verdict::Table(table),
            members.into_iter().flatten().map(|(_, fd)| fd),
        );
        ControlFlow::Break(())
    }

    /// Tells every rank that joined that the group will not form.
    fn refuse_all(self, kind: ErrorKind, message: String) {
        let Some(group) = self.group else { return };
        let members = group.members.into_iter().flatten().map(|(_, fd)| fd);
        tell_all(&refused(kind, message), members);
    }

    /// The deadline passed with ranks missing: tell those who came.
    fn refuse_missing(self) {
        let Some(group) = &self.group else { return };
        let missing: Vec<usize> = (0..group.world)
            .filter(|&r| group.members[r].is_none())
            .collect();
        let message = format!(
            "{} did not join within {} ({} of {} joined)",
            describe_ranks(&missing),
            seconds(group.timeout),
            group.joined,
            group.world
        );
        self.refuse_all(ErrorKind::Timeout, message);
    }
}

fn refused(kind: ErrorKind, message: String) -> Verdict {
    Verdict::Refused { kind, message }
}

/// Sends `verdict` to every connection, best effort: a rank that has gone
/// away simply does not hear it.
fn tell_all(verdict: &Verdict, fds: impl IntoIterator<Item = OwnedFd>) {
    let frame = framed(&verdict.encode());
    let deadline = Deadline::new(REPLY_TIMEOUT, None);
    for fd in fds {
        let _ = send_all(fd.as_fd(), &frame, &deadline, &|| {
            "replying to a rank".into()
        });
    }
}
