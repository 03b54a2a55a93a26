//! Joining a group, rank side: the rendezvous with the root, then the mesh
//! of connections between ranks.
//!
//! 1. Connect to the root (retrying while it is not up yet).
//! 2. Open this rank's mesh listener on the interface that reached the root:
//!    the route that works to the root is the best guess for the others.
//! 3. Send the secret and the hello; wait for the root's verdict.
//! 4. With the table in hand, open a Unix listener if other ranks share
//!    this host, connect to every lower rank (TCP, plus Unix on this host),
//!    then accept every higher rank. Each connection opens with the secret
//!    and the connecting rank's number. Lower ranks' listeners exist before
//!    their hello, so no connect here waits on a rank that is itself
//!    blocked; only the Unix listeners appear later (right after the table),
//!    and connects to them retry until they do.

use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use super::id::{host_id, UniqueId};
use super::net::{
    connect_retrying, pollfd, pollfd_opt, recv_exact, send_all, Deadline, Fill, Incoming, RawAddr,
    SLICE,
};
use super::wire::SECRET_BYTES;
use super::wire::{framed, put_u32, same_secret, to_u32, Hello, Member, Reader, Verdict};
use super::{describe_ranks, disconnected, HANDSHAKE_TIMEOUT};
use crate::error::{Error, Result};

/// How long past its own deadline a rank keeps listening for the root. The
/// root's deadline is the first arrival's, so for that rank both expire
/// together; the grace lets the root's message (which names the missing
/// ranks) arrive instead of a bare local timeout.
const ROOT_GRACE: Duration = Duration::from_millis(500);

/// What opens a mesh connection: the secret and the connecting rank.
const MESH_OPENING_BYTES: usize = SECRET_BYTES + 4;

/// A rank's view of the joined group.
pub(super) struct Mesh {
    pub table: Vec<Member>,
    /// Index = rank; `None` for this rank.
    pub tcp: Vec<Option<TcpStream>>,
    /// Index = rank; `Some` for the other ranks on this host.
    pub unix: Vec<Option<UnixStream>>,
}

/// Runs steps 1 to 4 of the module doc. The rendezvous and the mesh each get
/// the full `timeout`.
pub(super) fn join(
    id: &UniqueId,
    rank: usize,
    world: usize,
    timeout: Duration,
    abort: &AtomicBool,
) -> Result<Mesh> {
    let deadline = Deadline::new(timeout, Some(abort));
    let root_addr = id.root;
    let root = connect_retrying(&RawAddr::ip(&root_addr), &deadline, &|| {
        format!("could not reach the rendezvous root at {root_addr}")
    })?;
    let root = TcpStream::from(root);

    let mut listen_at = root
        .local_addr()
        .map_err(|e| Error::system("getsockname", e))?;
    listen_at.set_port(0);
    let listener = TcpListener::bind(listen_at)
        .map_err(|e| Error::system(&format!("binding the mesh listener to {listen_at}"), e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::system("making the mesh listener non-blocking", e))?;
    let hello = Hello {
        rank,
        world,
        host_id: host_id(),
        timeout: deadline.remaining(),
        listen: listener
            .local_addr()
            .map_err(|e| Error::system("getsockname", e))?,
    };
    let table = rendezvous(&root, id, &hello, &deadline)?;
    drop(root);

    let deadline = Deadline::new(timeout, Some(abort));
    connect_mesh(id, rank, table, listener, &deadline)
}

/// Step 3: hello out, verdict in.
fn rendezvous(
    root: &TcpStream,
    id: &UniqueId,
    hello: &Hello,
    deadline: &Deadline,
) -> Result<Vec<Member>> {
    let closed =
        || Error::remote("the rendezvous root closed the connection (is the unique id right?)");
    let mut opening = id.secret.to_vec();
    opening.extend_from_slice(&framed(&hello.encode()));
    send_all(root.as_fd(), &opening, deadline, &|| {
        "sending the hello to the rendezvous root".into()
    })
    .map_err(|f| f.or_closed(closed))?;

    let (rank, world) = (hello.rank, hello.world);
    let wait = deadline.extended(ROOT_GRACE);
    let what = || format!("rank {rank} waiting at the rendezvous root for all {world} ranks");
    let mut len = [0u8; 4];
    recv_exact(root.as_fd(), &mut len, &wait, &what).map_err(|f| f.or_closed(closed))?;
    let len = u32::from_le_bytes(len) as usize;
    let max = Verdict::max_len(world);
    if len > max {
        return Err(Error::remote(format!(
            "the rendezvous root sent a {len}-byte reply, more than the {max} bytes possible"
        )));
    }
    let mut body = vec![0u8; len];
    recv_exact(root.as_fd(), &mut body, &wait, &what).map_err(|f| f.or_closed(closed))?;
    match Verdict::decode(&body, world) {
        Some(Verdict::Table(table)) => Ok(table),
        Some(Verdict::Refused { kind, message }) => Err(Error::new(
            kind,
            format!("the rendezvous root refused the group: {message}"),
        )),
        None => Err(Error::remote("malformed reply from the rendezvous root")),
    }
}

/// The abstract Unix socket name of `rank` in `session`.
fn unix_name(session: u64, rank: usize) -> String {
    format!("ep-bootstrap/{session:016x}/{rank}")
}

/// Which listener a mesh connection came in on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Via {
    Tcp,
    Unix,
}

/// Step 4.
fn connect_mesh(
    id: &UniqueId,
    rank: usize,
    table: Vec<Member>,
    tcp_listener: TcpListener,
    deadline: &Deadline,
) -> Result<Mesh> {
    let world = table.len();
    let my_host = table[rank].host_id;
    let local: Vec<bool> = table.iter().map(|m| m.host_id == my_host).collect();
    let unix_listener = if local[rank + 1..].contains(&true) {
        let name = unix_name(id.session, rank);
        let bind = || {
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            let listener = UnixListener::bind_addr(&addr)?;
            listener.set_nonblocking(true)?;
            Ok(listener)
        };
        Some(bind().map_err(|e| Error::system(&format!("binding Unix socket @{name}"), e))?)
    } else {
        None
    };

    let mut mesh = Mesh {
        tcp: (0..world).map(|_| None).collect(),
        unix: (0..world).map(|_| None).collect(),
        table,
    };
    let mut opening = id.secret.to_vec();
    put_u32(&mut opening, to_u32(rank));

    for (peer, &same_host) in local.iter().enumerate().take(rank) {
        let addr = mesh.table[peer].listen;
        let what = || format!("rank {rank} connecting to rank {peer} at {addr}");
        let fd = connect_retrying(&RawAddr::ip(&addr), deadline, &what)?;
        send_opening(&fd, &opening, peer, deadline)?;
        let stream = TcpStream::from(fd);
        set_nodelay(&stream)?;
        mesh.tcp[peer] = Some(stream);

        if same_host {
            let name = unix_name(id.session, peer);
            let what = || format!("rank {rank} connecting to rank {peer} at Unix socket @{name}");
            let fd = connect_retrying(&RawAddr::abstract_unix(name.as_bytes()), deadline, &what)?;
            send_opening(&fd, &opening, peer, deadline)?;
            mesh.unix[peer] = Some(UnixStream::from(fd));
        }
    }

    accept_higher(
        id,
        rank,
        &mut mesh,
        &tcp_listener,
        unix_listener.as_ref(),
        deadline,
    )?;
    Ok(mesh)
}

fn send_opening(fd: &OwnedFd, opening: &[u8], peer: usize, deadline: &Deadline) -> Result<()> {
    send_all(fd.as_fd(), opening, deadline, &|| {
        format!("greeting rank {peer}")
    })
    .map_err(|f| f.or_closed(disconnected(peer)))
}

/// Small messages (barriers) must not wait for Nagle's algorithm.
fn set_nodelay(stream: &TcpStream) -> Result<()> {
    stream
        .set_nodelay(true)
        .map_err(|e| Error::system("setting TCP_NODELAY", e))
}

/// Accepts every higher rank's TCP connection, and the Unix one of each
/// higher rank on this host. Connections that do not open with the secret
/// and a plausible, not yet connected rank are closed and forgotten.
fn accept_higher(
    id: &UniqueId,
    rank: usize,
    mesh: &mut Mesh,
    tcp_listener: &TcpListener,
    unix_listener: Option<&UnixListener>,
    deadline: &Deadline,
) -> Result<()> {
    let world = mesh.table.len();
    let my_host = mesh.table[rank].host_id;
    let mut pending: Vec<(Via, Incoming)> = Vec::new();
    loop {
        let missing_tcp: Vec<usize> = (rank + 1..world)
            .filter(|&p| mesh.tcp[p].is_none())
            .collect();
        let missing_unix: Vec<usize> = (rank + 1..world)
            .filter(|&p| mesh.table[p].host_id == my_host && mesh.unix[p].is_none())
            .collect();
        if missing_tcp.is_empty() && missing_unix.is_empty() {
            return Ok(());
        }

        // Entries 0 and 1 are the listeners, left out once nobody more is
        // expected on them; then one entry per pending connection.
        let tcp_wanted = (!missing_tcp.is_empty()).then(|| tcp_listener.as_fd());
        let unix_wanted = unix_listener
            .filter(|_| !missing_unix.is_empty())
            .map(|l| l.as_fd());
        let mut fds = vec![
            pollfd_opt(tcp_wanted, libc::POLLIN),
            pollfd_opt(unix_wanted, libc::POLLIN),
        ];
        fds.extend(
            pending
                .iter()
                .map(|(_, p)| pollfd(p.fd.as_fd(), libc::POLLIN)),
        );
        deadline.wait(&mut fds, SLICE, &|| {
            let mut waiting = [missing_tcp.as_slice(), &missing_unix].concat();
            waiting.sort_unstable();
            waiting.dedup();
            format!(
                "rank {rank} waiting for {} to connect",
                describe_ranks(&waiting)
            )
        })?;

        for i in (0..pending.len()).rev() {
            if fds[i + 2].revents == 0 {
                continue;
            }
            match pending[i].1.fill() {
                Fill::More => {}
                Fill::Gone => drop(pending.swap_remove(i)),
                Fill::Full => {
                    let (via, conn) = pending.swap_remove(i);
                    let Some(peer) = opening_peer(&conn.buf, id, rank, mesh, via) else {
                        continue;
                    };
                    match via {
                        Via::Tcp => {
                            let stream = TcpStream::from(conn.fd);
                            set_nodelay(&stream)?;
                            mesh.tcp[peer] = Some(stream);
                        }
                        Via::Unix => mesh.unix[peer] = Some(UnixStream::from(conn.fd)),
                    }
                }
            }
        }
        let now = std::time::Instant::now();
        pending.retain(|(_, p)| p.deadline > now);

        if fds[0].revents != 0 {
            while let Ok((stream, _)) = tcp_listener.accept() {
                let conn = Incoming::new(stream.into(), MESH_OPENING_BYTES, HANDSHAKE_TIMEOUT);
                pending.push((Via::Tcp, conn));
            }
        }
        if let (Some(l), true) = (unix_listener, fds[1].revents != 0) {
            while let Ok((stream, _)) = l.accept() {
                let conn = Incoming::new(stream.into(), MESH_OPENING_BYTES, HANDSHAKE_TIMEOUT);
                pending.push((Via::Unix, conn));
            }
        }
    }
}

/// The rank a complete mesh opening names, if it carries the secret and names
/// a higher rank that has not connected over `via` yet (Unix: on this host).
fn opening_peer(
    opening: &[u8],
    id: &UniqueId,
    rank: usize,
    mesh: &Mesh,
    via: Via,
) -> Option<usize> {
    let (secret, peer) = opening.split_at(SECRET_BYTES);
    let peer = Reader::new(peer).u32()? as usize;
    if !same_secret(secret, &id.secret) || peer <= rank || peer >= mesh.table.len() {
        return None;
    }
    let free = match via {
        Via::Tcp => mesh.tcp[peer].is_none(),
        Via::Unix => {
            mesh.table[peer].host_id == mesh.table[rank].host_id && mesh.unix[peer].is_none()
        }
    };
    free.then_some(peer)
}
