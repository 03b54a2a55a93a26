//! Bootstrap: how the ranks of a job find each other before any GPU work.
//!
//! The model is NCCL's. One rank calls [`create_unique_id`], which starts a
//! *rendezvous root* (a background thread listening on a TCP port) and
//! returns a 128-byte id naming it. The caller ships the id to every other
//! rank by its own means (MPI, a file, an environment variable); every rank,
//! the creator included, then calls [`Bootstrap::connect`] with the id, its
//! rank and the world size. Ranks may be threads of one process or separate
//! processes on one or many hosts.
//!
//! # Protocol
//!
//! 1. Each rank opens a TCP listener of its own, connects to the root and
//!    sends the id's secret plus a hello (rank, world, host id, listener
//!    address, timeout).
//! 2. When all `world` ranks have said hello, the root sends every one the
//!    table (each rank's host id and listener address) and exits. If the
//!    group cannot form (ranks missing at the deadline, a rank claimed
//!    twice, disagreement on the world size), it sends everyone the reason
//!    instead, and exits.
//! 3. Each rank connects to every lower rank over TCP and, when both are on
//!    the same host, over an abstract Unix socket too (for passing file
//!    descriptors); each connection opens with the secret and the rank.
//!
//! After that the root is gone and ranks talk directly: [`Bootstrap::barrier`],
//! [`Bootstrap::all_gather`] and [`Bootstrap::all_gather_fds`]. Every
//! blocking step waits in slices of at most 50 ms, gives up with
//! `ErrorKind::Timeout` after the timeout given to `connect`, and with
//! `ErrorKind::Aborted` soon after the abort flag is set.
//!
//! # Environment
//!
//! Read by [`create_unique_id`] only, to pick the root's address (ranks put
//! their own listener on whichever local address reaches the root):
//!
//! - `EP_SOCKET_ADDR`: use this address, `IP` or `IP:port` (`[v6]:port`).
//!   Wins over `EP_SOCKET_IFNAME`.
//! - `EP_SOCKET_IFNAME`: use this network interface's address (its IPv4
//!   one if it has one, else its IPv6 one).
//!
//! With neither, the root takes the first interface that is up, not
//! loopback and has an IPv4 address, else 127.0.0.1.

mod collective;
mod fdpass;
mod id;
mod join;
mod net;
mod root;
mod wire;

#[cfg(test)]
mod tests;

use std::cell::{Cell, RefCell};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::config::Config;
use crate::error::{Error, Result};
use collective::Op;
use id::UniqueId;
use net::Deadline;

pub const UNIQUE_ID_BYTES: usize = 128;

/// Largest contribution of one rank to [`Bootstrap::all_gather`].
const MAX_GATHER_BYTES: usize = 16 << 20;

/// Largest world size accepted (the root's table must stay small).
const MAX_WORLD: usize = 1 << 16;

/// How long an accepted connection may take to send its opening bytes
/// (secret and hello, or secret and rank) before it is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// Starts the rendezvous root (a background thread listening on a TCP port) and returns the id.
pub fn create_unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let addr = net::choose_root_address(
        env("EP_SOCKET_ADDR").as_deref(),
        env("EP_SOCKET_IFNAME").as_deref(),
    )?;
    start_root(addr)
}

/// Starts a root listening at `addr` (port 0: any free port).
fn start_root(addr: SocketAddr) -> Result<[u8; UNIQUE_ID_BYTES]> {
    let listener = TcpListener::bind(addr)
        .map_err(|e| Error::system(&format!("binding the rendezvous root to {addr}"), e))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::system("getsockname", e))?;
    let id = UniqueId::generate(bound)?;
    root::spawn(listener, id.secret, id.session)?;
    Ok(id.encode())
}

/// Gives up on group `id` from this process: if this process runs its
/// rendezvous root and the group has not formed yet, the root stops now
/// (freeing its thread and port) and tells the ranks that joined `reason`
/// (`EP_ERR_REMOTE`). Called when a rank's `ep_ctx_create` fails, since the
/// group can then never form. Ids that are not ours, or whose root is
/// elsewhere or gone, are left alone.
pub fn release_unique_id(id: &[u8; UNIQUE_ID_BYTES], reason: &str) {
    if let Ok(id) = UniqueId::decode(id) {
        root::stop(id.session, reason.to_string());
    }
}

/// One rank's membership in a joined group.
pub struct Bootstrap {
    rank: usize,
    world: usize,
    /// Ranks on this host, ascending, this one included.
    local: Vec<usize>,
    /// Index = rank; `None` for this rank.
    tcp: Vec<Option<TcpStream>>,
    /// Index = rank; `Some` for the other ranks on this host.
    unix: Vec<Option<UnixStream>>,
    timeout: Duration,
    abort: Arc<AtomicBool>,
    /// Number of the next collective step; see `collective`.
    seq: Cell<u32>,
    /// The first failure of a collective. A failed collective may leave a
    /// message half sent or half read, so every later call repeats it.
    failed: RefCell<Option<Error>>,
}

impl Bootstrap {
    /// Joins the group of `id` as `cfg`'s rank (with an abort flag of its
    /// own, returned beside it) and settles the configuration with the
    /// other ranks ([`Config::settle`]): the start every backend shares.
    pub fn join(
        id: &[u8; UNIQUE_ID_BYTES],
        cfg: &mut Config,
    ) -> Result<(Bootstrap, Arc<AtomicBool>)> {
        let aborted = Arc::new(AtomicBool::new(false));
        let boot = Bootstrap::connect(id, cfg.rank, cfg.world(), cfg.timeout, aborted.clone())?;
        cfg.settle(&boot, boot.local_ranks())?;
        Ok((boot, aborted))
    }

    /// Joins the group; returns when all `world` ranks have joined and the mesh is connected.
    ///
    /// The rendezvous at the root and the connection of the mesh each wait
    /// up to `timeout`.
    pub fn connect(
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        world: usize,
        timeout: Duration,
        abort: Arc<AtomicBool>,
    ) -> Result<Bootstrap> {
        if world == 0 || world > MAX_WORLD {
            return Err(Error::invalid(format!(
                "world size {world} is out of range (1..={MAX_WORLD})"
            )));
        }
        if rank >= world {
            return Err(Error::invalid(format!(
                "rank {rank} is out of range for a world of {world}"
            )));
        }
        let id = UniqueId::decode(id)?;
        let mesh = join::join(&id, rank, world, timeout, &abort)?;
        let my_host = mesh.table[rank].host_id;
        let local: Vec<usize> = (0..world)
            .filter(|&r| mesh.table[r].host_id == my_host)
            .collect();
        let mut hosts: Vec<u64> = mesh.table.iter().map(|m| m.host_id).collect();
        hosts.sort_unstable();
        hosts.dedup();
        crate::runtime::log::info!(
            "bootstrap: {world} ranks on {} host(s); ranks on this host: {local:?}",
            hosts.len()
        );
        Ok(Bootstrap {
            rank,
            world,
            local,
            tcp: mesh.tcp,
            unix: mesh.unix,
            timeout,
            abort,
            seq: Cell::new(0),
            failed: RefCell::new(None),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Ranks on this host (same host id), ascending, including this one.
    pub fn local_ranks(&self) -> &[usize] {
        &self.local
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.collective(|deadline| {
            // Dissemination barrier: in round k each rank signals rank + 2^k
            // and waits for rank - 2^k. After ceil(log2(world)) rounds every
            // rank has heard, directly or not, from every other.
            let mut step = 1;
            while step < self.world {
                let to = (self.rank + step) % self.world;
                let from = (self.rank + self.world - step) % self.world;
                self.exchange(Op::Barrier, &[], &[to], &[from], 0, deadline)?;
                step *= 2;
            }
            Ok(())
        })
    }

    /// Every rank's bytes, index = rank (lengths may differ; each at most 16 MiB).
    pub fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        if mine.len() > MAX_GATHER_BYTES {
            return Err(Error::invalid(format!(
                "all_gather takes at most {MAX_GATHER_BYTES} bytes per rank, got {}",
                mine.len()
            )));
        }
        self.collective(|deadline| {
            let others: Vec<usize> = (0..self.world).filter(|&r| r != self.rank).collect();
            let theirs = self.exchange(
                Op::AllGather,
                mine,
                &others,
                &others,
                MAX_GATHER_BYTES,
                deadline,
            )?;
            let mut all = theirs;
            all.insert(self.rank, mine.to_vec());
            Ok(all)
        })
    }

    /// Sends `fd` to every other rank on this host and receives theirs (SCM_RIGHTS over a Unix socket).
    /// Result index = rank: Some(own duplicate or the received fd) for local ranks (own entry: a dup of `fd`), None for ranks on other hosts.
    pub fn all_gather_fds(&self, fd: BorrowedFd) -> Result<Vec<Option<OwnedFd>>> {
        let own = fd
            .try_clone_to_owned()
            .map_err(|e| Error::system("duplicating the descriptor", e))?;
        self.collective(|deadline| self.exchange_fds(fd, own, deadline))
    }

    fn next_seq(&self) -> u32 {
        let seq = self.seq.get();
        self.seq.set(seq.wrapping_add(1));
        seq
    }

    /// Runs one collective with a fresh deadline, unless an earlier one
    /// failed; remembers a failure for the calls that follow.
    fn collective<T>(&self, body: impl FnOnce(&Deadline) -> Result<T>) -> Result<T> {
        if let Some(first) = self.failed.borrow().as_ref() {
            return Err(Error::new(
                first.kind,
                format!("an earlier bootstrap collective failed: {}", first.message),
            ));
        }
        let deadline = Deadline::new(self.timeout, Some(&*self.abort));
        let result = body(&deadline);
        if let Err(e) = &result {
            *self.failed.borrow_mut() = Some(e.clone());
        }
        result
    }
}

/// "rank 3", or "ranks 0, 2-5" for a sorted list.
fn describe_ranks(ranks: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let start = ranks[i];
        while i + 1 < ranks.len() && ranks[i + 1] == ranks[i] + 1 {
            i += 1;
        }
        parts.push(if ranks[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", ranks[i])
        });
        i += 1;
    }
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", parts.join(", "))
}

/// The error for a peer that closed its end.
fn disconnected(peer: usize) -> impl FnOnce() -> Error {
    move || Error::remote(format!("rank {peer} disconnected"))
}

/// A duration for messages: "1.5 s".
fn seconds(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}
