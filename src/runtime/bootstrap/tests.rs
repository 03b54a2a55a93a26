//! Tests. All traffic stays on the loopback interface.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::thread;
use std::time::Instant;

use super::*;
use crate::error::ErrorKind;

const TIMEOUT: Duration = Duration::from_secs(3);

fn loopback_id() -> [u8; UNIQUE_ID_BYTES] {
    start_root("127.0.0.1:0".parse().unwrap()).unwrap()
}

fn no_abort() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(false))
}

/// Runs one thread per `(rank, world)`, each joining with `timeout` and
/// handing the outcome to `body`; returns the bodies' results in order.
fn run_ranks<T: Send>(
    id: &[u8; UNIQUE_ID_BYTES],
    ranks: &[(usize, usize)],
    timeout: Duration,
    body: impl Fn(usize, Result<Bootstrap>) -> T + Sync,
) -> Vec<T> {
    thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&(rank, world)| {
                let body = &body;
                s.spawn(move || {
                    body(
                        rank,
                        Bootstrap::connect(id, rank, world, timeout, no_abort()),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn full_world(world: usize) -> Vec<(usize, usize)> {
    (0..world).map(|r| (r, world)).collect()
}

/// A memfd holding `text`.
fn memfd_with(text: &str) -> File {
    // SAFETY: plain memfd_create call with a NUL-terminated name.
    let raw = unsafe { libc::memfd_create(c"ep-bootstrap-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0, "memfd_create failed");
    // SAFETY: `raw` is a new descriptor owned by nobody else.
    let mut file = unsafe { File::from_raw_fd(raw) };
    file.write_all(text.as_bytes()).unwrap();
    file
}

fn read_fd(fd: &OwnedFd) -> String {
    let file = File::from(fd.try_clone().unwrap());
    let mut buf = [0u8; 64];
    let n = file.read_at(&mut buf, 0).unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn payload(rank: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + rank) as u8).collect()
}

#[test]
fn bootstrap_is_send() {
    fn send<T: Send>() {}
    send::<Bootstrap>();
}

#[test]
fn four_threads_gather_barrier_and_pass_fds() {
    let id = loopback_id();
    run_ranks(&id, &full_world(4), TIMEOUT, |rank, b| {
        let b = b.unwrap();
        assert_eq!((b.rank(), b.world()), (rank, 4));
        assert_eq!(b.local_ranks(), &[0, 1, 2, 3]);

        let all = b.all_gather(&payload(rank, rank * 1000 + 1)).unwrap();
        for (peer, bytes) in all.iter().enumerate() {
            assert_eq!(*bytes, payload(peer, peer * 1000 + 1));
        }
        // Large enough to overflow every socket buffer in both directions.
        let big = b.all_gather(&payload(rank, 4 << 20)).unwrap();
        assert!(big
            .iter()
            .enumerate()
            .all(|(p, v)| *v == payload(p, 4 << 20)));

        for _ in 0..50 {
            b.barrier().unwrap();
        }

        let mine = memfd_with(&format!("written by rank {rank}"));
        let fds = b.all_gather_fds(mine.as_fd()).unwrap();
        assert_eq!(fds.len(), 4);
        for (peer, fd) in fds.into_iter().enumerate() {
            let fd = fd.expect("every rank is local");
            if peer == rank {
                assert_ne!(fd.as_raw_fd(), mine.as_raw_fd(), "own entry is a dup");
            }
            assert_eq!(read_fd(&fd), format!("written by rank {peer}"));
        }
        b.barrier().unwrap();
    });
}

#[test]
fn world_of_one() {
    let id = loopback_id();
    let b = Bootstrap::connect(&id, 0, 1, TIMEOUT, no_abort()).unwrap();
    b.barrier().unwrap();
    assert_eq!(b.all_gather(b"solo").unwrap(), vec![b"solo".to_vec()]);
    let file = memfd_with("solo");
    let fds = b.all_gather_fds(file.as_fd()).unwrap();
    assert_eq!(read_fd(fds[0].as_ref().unwrap()), "solo");
}

/// Exit codes of the forked ranks.
const CHILD_OK: i32 = 0;
const CHILD_CONNECT: i32 = 10;
const CHILD_GATHER: i32 = 11;
const CHILD_FDS: i32 = 12;
const CHILD_BARRIER: i32 = 13;
const CHILD_PANIC: i32 = 99;

/// A forked rank: join, gather, swap memfds, barrier. Returns an exit code.
fn child_rank(id: &[u8; UNIQUE_ID_BYTES], rank: usize, world: usize) -> i32 {
    let Ok(b) = Bootstrap::connect(id, rank, world, TIMEOUT, no_abort()) else {
        return CHILD_CONNECT;
    };
    match b.all_gather(&payload(rank, 100 + rank)) {
        Ok(all) if (0..world).all(|p| all[p] == payload(p, 100 + p)) => {}
        _ => return CHILD_GATHER,
    }
    let mine = memfd_with(&format!("process of rank {rank}"));
    match b.all_gather_fds(mine.as_fd()) {
        Ok(fds) if b.local_ranks().len() == world => {
            for (p, fd) in fds.iter().enumerate() {
                match fd {
                    Some(fd) if read_fd(fd) == format!("process of rank {p}") => {}
                    _ => return CHILD_FDS,
                }
            }
        }
        _ => return CHILD_FDS,
    }
    if b.barrier().is_err() {
        return CHILD_BARRIER;
    }
    CHILD_OK
}

#[test]
fn four_forked_processes() {
    const WORLD: usize = 4;
    let id = loopback_id();
    let mut children = Vec::new();
    for rank in 0..WORLD {
        // SAFETY: the child runs only our own code (no locks the parent's
        // other threads could hold, beyond malloc, which glibc resets at
        // fork) and leaves with _exit, never returning into the harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // Drop the descriptors inherited from other tests' threads, so
            // this child cannot keep their sockets open behind their backs.
            // SAFETY: the child owns no Rust object using those descriptors.
            unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
            let code =
                std::panic::catch_unwind(|| child_rank(&id, rank, WORLD)).unwrap_or(CHILD_PANIC);
            // SAFETY: ends the child without running the parent's atexit
            // handlers or destructors.
            unsafe { libc::_exit(code) };
        }
        children.push(pid);
    }

    let give_up = Instant::now() + Duration::from_secs(10);
    let mut codes = vec![None; WORLD];
    while codes.iter().any(Option::is_none) && Instant::now() < give_up {
        for (i, &pid) in children.iter().enumerate() {
            if codes[i].is_some() {
                continue;
            }
            let mut status = 0;
            // SAFETY: waits for our own child without blocking.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                codes[i] = Some(if libc::WIFEXITED(status) {
                    libc::WEXITSTATUS(status)
                } else {
                    -1
                });
            }
        }
        thread::sleep(Duration::from_millis(10));
    }
    for (i, &pid) in children.iter().enumerate() {
        if codes[i].is_none() {
            // SAFETY: kills and reaps our own stuck child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
        }
    }
    assert_eq!(codes, vec![Some(CHILD_OK); WORLD]);
}

#[test]
fn garbage_id_is_rejected_locally() {
    let check = |id: &[u8; UNIQUE_ID_BYTES]| {
        let err = Bootstrap::connect(id, 0, 2, TIMEOUT, no_abort())
            .err()
            .unwrap();
        assert_eq!(err.kind, ErrorKind::InvalidArgument, "{err}");
        assert!(err.message.contains("not an ep unique id"), "{err}");
    };
    check(&[0u8; UNIQUE_ID_BYTES]);
    let mut noise = [0u8; UNIQUE_ID_BYTES];
    id::random_bytes(&mut noise).unwrap();
    check(&noise);

    let mut corrupted = loopback_id();
    corrupted[40] ^= 0x01;
    check(&corrupted);
}

#[test]
fn id_round_trips() {
    let addrs = ["127.0.0.1:4242", "[fe80::1%3]:7", "[::1]:65535"];
    for addr in addrs {
        let addr: SocketAddr = addr.parse().unwrap();
        let id = UniqueId::generate(addr).unwrap();
        assert_eq!(UniqueId::decode(&id.encode()).unwrap(), id);
    }
}

#[test]
fn wrong_secret_is_turned_away_and_root_keeps_serving() {
    let id = loopback_id();
    let mut forged = UniqueId::decode(&id).unwrap();
    forged.secret[0] ^= 0xff;
    let start = Instant::now();
    let err = Bootstrap::connect(&forged.encode(), 0, 2, TIMEOUT, no_abort())
        .err()
        .unwrap();
    assert!(
        matches!(err.kind, ErrorKind::Remote | ErrorKind::Timeout),
        "{err}"
    );
    if err.kind == ErrorKind::Remote {
        assert!(err.message.contains("is the unique id right?"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(1), "{err}");
    }

    let results = run_ranks(&id, &full_world(2), TIMEOUT, |_, b| b.map(|b| b.world()));
    assert_eq!(results, vec![Ok(2), Ok(2)]);
}

#[test]
fn bad_rank_or_world_is_invalid() {
    let id = loopback_id();
    for (rank, world) in [(4, 4), (0, 0), (0, MAX_WORLD + 1)] {
        let err = Bootstrap::connect(&id, rank, world, TIMEOUT, no_abort())
            .err()
            .unwrap();
        assert_eq!(err.kind, ErrorKind::InvalidArgument, "{err}");
    }
}

#[test]
fn rank_claimed_twice() {
    let id = loopback_id();
    let results = run_ranks(&id, &[(0, 3), (0, 3)], TIMEOUT, |_, b| b.err().unwrap());
    for err in results {
        assert_eq!(err.kind, ErrorKind::InvalidArgument, "{err}");
        assert!(err.message.contains("rank 0 claimed twice"), "{err}");
    }
}

#[test]
fn missing_rank_times_out_naming_it() {
    let id = loopback_id();
    let timeout = Duration::from_secs(1);
    let start = Instant::now();
    let results = run_ranks(&id, &[(0, 3), (1, 3)], timeout, |_, b| b.err().unwrap());
    let elapsed = start.elapsed();
    for err in results {
        assert_eq!(err.kind, ErrorKind::Timeout, "{err}");
        assert!(err.message.contains("rank 2 did not join"), "{err}");
    }
    assert!(elapsed < Duration::from_millis(1800), "took {elapsed:?}");
}

#[test]
fn world_size_disagreement() {
    let id = loopback_id();
    let results = run_ranks(&id, &[(0, 2), (1, 3)], TIMEOUT, |_, b| b.err().unwrap());
    for err in results {
        assert_eq!(err.kind, ErrorKind::InvalidArgument, "{err}");
        assert!(err.message.contains("world size disagreement"), "{err}");
        assert!(
            err.message.contains("says 2") && err.message.contains("says 3"),
            "{err}"
        );
    }
}

#[test]
fn unreachable_root_times_out() {
    // Bind a port, then free it: nobody listens there any more.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let id = UniqueId::generate(port).unwrap().encode();
    let start = Instant::now();
    let err = Bootstrap::connect(&id, 0, 2, Duration::from_millis(300), no_abort())
        .err()
        .unwrap();
    assert_eq!(err.kind, ErrorKind::Timeout, "{err}");
    assert!(
        err.message
            .contains("could not reach the rendezvous root at"),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[test]
fn abort_interrupts_a_waiting_barrier() {
    let id = loopback_id();
    let abort = no_abort();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    thread::scope(|s| {
        let id = &id;
        let idle_peer = s.spawn(move || {
            let b = Bootstrap::connect(id, 1, 2, TIMEOUT, no_abort()).unwrap();
            // Never enters the barrier; stays connected until rank 0 is done.
            done_rx.recv().unwrap();
            drop(b);
        });
        let b = Bootstrap::connect(id, 0, 2, TIMEOUT, abort.clone()).unwrap();
        let setter = s.spawn(|| {
            thread::sleep(Duration::from_millis(200));
            abort.store(true, Ordering::Relaxed);
            Instant::now()
        });
        let err = b.barrier().err().unwrap();
        let returned = Instant::now();
        let set_at = setter.join().unwrap();
        assert_eq!(err.kind, ErrorKind::Aborted, "{err}");
        assert!(returned.duration_since(set_at) < Duration::from_millis(200));
        // The failure sticks: the streams may be mid-message.
        assert_eq!(b.barrier().err().unwrap().kind, ErrorKind::Aborted);
        done_tx.send(()).unwrap();
        idle_peer.join().unwrap();
    });
}

#[test]
fn departed_peer_is_reported() {
    let id = loopback_id();
    let (gone_tx, gone_rx) = mpsc::channel::<()>();
    thread::scope(|s| {
        s.spawn(|| {
            let b = Bootstrap::connect(&id, 1, 2, TIMEOUT, no_abort()).unwrap();
            drop(b);
            gone_tx.send(()).unwrap();
        });
        let b = Bootstrap::connect(&id, 0, 2, TIMEOUT, no_abort()).unwrap();
        gone_rx.recv().unwrap();
        let err = b.all_gather(b"anyone?").err().unwrap();
        assert_eq!(err.kind, ErrorKind::Remote, "{err}");
        assert!(err.message.contains("rank 1 disconnected"), "{err}");
    });
}

#[test]
fn hostile_clients_do_not_stop_the_root() {
    let id = loopback_id();
    let decoded = UniqueId::decode(&id).unwrap();
    let connect = || {
        let s = TcpStream::connect(decoded.root).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s
    };

    let mut garbage = connect();
    garbage.write_all(&[0xAB; 100]).unwrap();

    let mut huge = connect();
    huge.write_all(&decoded.secret).unwrap();
    huge.write_all(&u32::MAX.to_le_bytes()).unwrap();

    let mut bad_hello = connect();
    bad_hello.write_all(&decoded.secret).unwrap();
    bad_hello
        .write_all(&(wire::HELLO_BYTES as u32).to_le_bytes())
        .unwrap();
    bad_hello.write_all(&[0xFF; wire::HELLO_BYTES]).unwrap();

    let silent = connect();

    let results = run_ranks(&id, &full_world(3), TIMEOUT, |_, b| b.map(|b| b.world()));
    assert_eq!(results, vec![Ok(3); 3]);

    // Each talker was dropped without a reply: end of stream or a reset.
    for mut stream in [garbage, huge, bad_hello] {
        let mut buf = [0u8; 16];
        match stream.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("expected the root to drop the client, got {other:?}"),
        }
    }
    drop(silent);
}

#[test]
fn root_address_choice() {
    let pick =
        |forced: Option<&str>, ifname: Option<&str>| net::choose_root_address(forced, ifname);
    assert_eq!(
        pick(Some("127.0.0.1"), Some("nope0")).unwrap(),
        "127.0.0.1:0".parse().unwrap()
    );
    assert_eq!(
        pick(Some("[::1]:5000"), None).unwrap(),
        "[::1]:5000".parse().unwrap()
    );
    assert_eq!(
        pick(Some("nonsense"), None).unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        pick(Some("0.0.0.0"), None).unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        pick(None, Some("lo")).unwrap(),
        "127.0.0.1:0".parse().unwrap()
    );
    assert_eq!(
        pick(None, Some("no-such-if0")).unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
    let default = pick(None, None).unwrap();
    assert!(default.is_ipv4() && default.port() == 0);
}

#[test]
fn rank_lists_read_well() {
    assert_eq!(describe_ranks(&[3]), "rank 3");
    assert_eq!(describe_ranks(&[0, 2, 3, 4, 7]), "ranks 0, 2-4, 7");
}

#[test]
fn ipv6_loopback_group() {
    if TcpListener::bind("[::1]:0").is_err() {
        eprintln!("no IPv6 loopback here; nothing to test");
        return;
    }
    let id = start_root("[::1]:0".parse().unwrap()).unwrap();
    run_ranks(&id, &full_world(2), TIMEOUT, |rank, b| {
        let all = b.unwrap().all_gather(&[rank as u8]).unwrap();
        assert_eq!(all, vec![vec![0], vec![1]]);
    });
}

#[test]
fn mismatched_collectives_are_reported() {
    let id = loopback_id();
    let errors = run_ranks(&id, &full_world(2), TIMEOUT, |rank, b| {
        let b = b.unwrap();
        let result = if rank == 0 {
            b.barrier()
        } else {
            b.all_gather(b"out of step").map(drop)
        };
        result.err().unwrap()
    });
    for err in errors {
        assert_eq!(err.kind, ErrorKind::Remote, "{err}");
        assert!(err.message.contains("out of step"), "{err}");
    }
}
