//! Messages between ranks, and the engine that moves them.
//!
//! Every message is a 12-byte header (operation, sequence number, body
//! length; u32 each, little-endian) and the body. The sequence number counts
//! collective steps on each rank (a barrier takes several), so every rank
//! gives the same step the same number; a message with another operation or
//! number means the ranks called collectives in different orders, which is
//! reported rather than silently mixing data.

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};

use super::net::{pollfd, recv_some, send_some, Deadline, Fail, SLICE};
use super::wire::{put_u32, to_u32, Reader};
use super::{describe_ranks, disconnected, Bootstrap};
use crate::error::{Error, Result};

pub(super) const HEADER_BYTES: usize = 12;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    AllGather = 1,
    Barrier = 2,
    AllGatherFds = 3,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::AllGather => "all_gather",
            Op::Barrier => "barrier",
            Op::AllGatherFds => "all_gather_fds",
        })
    }
}

pub(super) fn header(op: Op, seq: u32, len: usize) -> [u8; HEADER_BYTES] {
    let mut out = Vec::with_capacity(HEADER_BYTES);
    put_u32(&mut out, op as u32);
    put_u32(&mut out, seq);
    put_u32(&mut out, to_u32(len));
    let mut head = [0u8; HEADER_BYTES];
    head.copy_from_slice(&out);
    head
}

/// Checks a header from `peer` against the message this rank expects and
/// returns the body length (at most `max_len`).
pub(super) fn check_header(
    head: &[u8; HEADER_BYTES],
    op: Op,
    seq: u32,
    max_len: usize,
    peer: usize,
) -> Result<usize> {
    let mut r = Reader::new(head);
    let (their_op, their_seq, len) = (r.u32(), r.u32(), r.u32());
    if their_op != Some(op as u32) || their_seq != Some(seq) {
        let theirs = [Op::AllGather, Op::Barrier, Op::AllGatherFds]
            .into_iter()
            .find(|o| Some(*o as u32) == their_op)
            .map_or("an unknown message".to_string(), |o| o.to_string());
        return Err(Error::remote(format!(
            "rank {peer} is out of step: it sent {theirs} #{} while this rank is in {op} #{seq} \
             (do all ranks call the same collectives in the same order?)",
            their_seq.unwrap_or(0)
        )));
    }
    let len = len.unwrap_or(0) as usize;
    if len > max_len {
        return Err(Error::remote(format!(
            "rank {peer} sent {len} bytes in {op}, more than the {max_len} allowed"
        )));
    }
    Ok(len)
}

/// A message on its way to one peer; all peers get the same frame.
struct Outgoing<'a> {
    peer: usize,
    fd: BorrowedFd<'a>,
    sent: usize,
}

/// A message arriving from one peer.
struct Inbound<'a> {
    peer: usize,
    fd: BorrowedFd<'a>,
    head: [u8; HEADER_BYTES],
    /// Bytes received, header included.
    got: usize,
    /// Allocated once the header has been checked.
    body: Option<Vec<u8>>,
}

impl Inbound<'_> {
    fn done(&self) -> bool {
        self.body
            .as_ref()
            .is_some_and(|b| self.got == HEADER_BYTES + b.len())
    }
}

impl Bootstrap {
    /// One round of point-to-point traffic, the next collective step in
    /// sequence: sends `payload` to every rank in `to` while receiving one
    /// message from every rank in `from`; returns the bodies in `from`'s
    /// order. Sending and receiving are multiplexed in one poll loop, so
    /// large payloads in both directions cannot deadlock.
    pub(super) fn exchange(
        &self,
        op: Op,
        payload: &[u8],
        to: &[usize],
        from: &[usize],
        max_len: usize,
        deadline: &Deadline,
    ) -> Result<Vec<Vec<u8>>> {
        let (me, seq) = (self.rank, self.next_seq());
        let link = |peer: usize| {
            self.tcp
                .get(peer)
                .and_then(|l| l.as_ref())
                .map(|l| l.as_fd())
                .ok_or_else(|| {
                    Error::internal(format!("rank {me} has no connection to rank {peer}"))
                })
        };
        let mut frame = header(op, seq, payload.len()).to_vec();
        frame.extend_from_slice(payload);
        let mut outs = Vec::with_capacity(to.len());
        for &peer in to {
            outs.push(Outgoing {
                peer,
                fd: link(peer)?,
                sent: 0,
            });
        }
        let mut ins = Vec::with_capacity(from.len());
        for &peer in from {
            ins.push(Inbound {
                peer,
                fd: link(peer)?,
                head: [0; HEADER_BYTES],
                got: 0,
                body: None,
            });
        }

        loop {
            // Poll entries: unfinished sends first, then unfinished receives;
            // `slots` maps each entry back to its message.
            let mut fds = Vec::new();
            let mut slots = Vec::new();
            for (i, o) in outs.iter().enumerate() {
                if o.sent < frame.len() {
                    fds.push(pollfd(o.fd, libc::POLLOUT));
                    slots.push((true, i));
                }
            }
            for (i, m) in ins.iter().enumerate() {
                if !m.done() {
                    fds.push(pollfd(m.fd, libc::POLLIN));
                    slots.push((false, i));
                }
            }
            if fds.is_empty() {
                break;
            }
            deadline.wait(&mut fds, SLICE, &|| {
                let mut waiting: Vec<usize> = slots
                    .iter()
                    .map(|&(out, i)| if out { outs[i].peer } else { ins[i].peer })
                    .collect();
                waiting.sort_unstable();
                waiting.dedup();
                format!(
                    "{op} #{seq} on rank {me}: waiting for {}",
                    describe_ranks(&waiting)
                )
            })?;

            for (pfd, &(out, i)) in fds.iter().zip(&slots) {
                if pfd.revents == 0 {
                    continue;
                }
                if out {
                    let o = &mut outs[i];
                    let n = send_some(o.fd, &frame[o.sent..])
                        .map_err(|f| f.or_closed(disconnected(o.peer)))?;
                    o.sent += n.unwrap_or(0);
                } else {
                    receive_some(&mut ins[i], op, seq, max_len)
                        .map_err(|f| f.or_closed(disconnected(ins[i].peer)))?;
                }
            }
        }
        Ok(ins
            .into_iter()
            .map(|m| m.body.unwrap_or_default())
            .collect())
    }
}

/// Reads what has arrived of one message, without blocking.
fn receive_some(
    m: &mut Inbound,
    op: Op,
    seq: u32,
    max_len: usize,
) -> std::result::Result<(), Fail> {
    match &mut m.body {
        None => {
            let n = recv_some(m.fd, &mut m.head[m.got..])?;
            m.got += n.unwrap_or(0);
            if m.got == HEADER_BYTES {
                let len = check_header(&m.head, op, seq, max_len, m.peer)?;
                m.body = Some(vec![0; len]);
            }
        }
        Some(body) => {
            let n = recv_some(m.fd, &mut body[m.got - HEADER_BYTES..])?;
            m.got += n.unwrap_or(0);
        }
    }
    Ok(())
}
