//! Byte layouts shared by the unique id, the root protocol and the mesh
//! handshake. Every integer is little-endian. Decoding never panics: a short
//! or malformed input yields `None`, and the caller decides what that means.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::time::Duration;

use crate::error::ErrorKind;

/// Length of the shared secret that opens every connection.
pub(super) const SECRET_BYTES: usize = 32;

/// Encoded socket address: family (4 or 6), one zero byte, port, IPv6 scope
/// id, then 16 address bytes (an IPv4 address uses the first 4).
pub(super) const ADDR_BYTES: usize = 24;

/// A rank's hello to the root: rank, world, host id, timeout in ms, listener.
pub(super) const HELLO_BYTES: usize = 4 + 4 + 8 + 8 + ADDR_BYTES;

/// One row of the table the root sends back: host id and listener address.
pub(super) const MEMBER_BYTES: usize = 8 + ADDR_BYTES;

/// Longest error text the root sends; longer texts are cut.
pub(super) const MAX_ERROR_TEXT: usize = 4096;

/// Tags of the root's reply.
const REPLY_TABLE: u8 = 1;
const REPLY_ERROR: u8 = 2;

/// Cursor over received bytes.
pub(super) struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Reader { rest: bytes }
    }

    pub(super) fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.rest.len() < n {
            return None;
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Some(head)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.bytes(N)?.try_into().ok()
    }

    pub(super) fn u8(&mut self) -> Option<u8> {
        Some(self.array::<1>()?[0])
    }

    pub(super) fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.array()?))
    }

    pub(super) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.array()?))
    }

    pub(super) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.array()?))
    }

    pub(super) fn addr(&mut self) -> Option<SocketAddr> {
        let family = self.u8()?;
        self.u8()?;
        let port = self.u16()?;
        let scope = self.u32()?;
        let ip: [u8; 16] = self.array()?;
        match family {
            4 => {
                let v4 = Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]);
                Some(SocketAddr::new(IpAddr::V4(v4), port))
            }
            6 => Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(ip),
                port,
                0,
                scope,
            ))),
            _ => None,
        }
    }

    /// Everything not read yet.
    pub(super) fn rest(self) -> &'a [u8] {
        self.rest
    }
}

pub(super) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(super) fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(super) fn put_addr(out: &mut Vec<u8>, addr: &SocketAddr) {
    let mut ip = [0u8; 16];
    let (family, scope) = match addr {
        SocketAddr::V4(a) => {
            ip[..4].copy_from_slice(&a.ip().octets());
            (4u8, 0u32)
        }
        SocketAddr::V6(a) => {
            ip = a.ip().octets();
            (6u8, a.scope_id())
        }
    };
    out.push(family);
    out.push(0);
    out.extend_from_slice(&addr.port().to_le_bytes());
    out.extend_from_slice(&scope.to_le_bytes());
    out.extend_from_slice(&ip);
}

/// Narrows a count to the u32 the protocol carries (saturating; callers keep
/// their values far below the limit).
pub(super) fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// What a rank tells the root about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hello {
    pub rank: usize,
    pub world: usize,
    pub host_id: u64,
    /// How long the rank will wait for the others; the root uses the first
    /// arrival's value as the group's deadline.
    pub timeout: Duration,
    /// Where the rank's mesh listener accepts connections.
    pub listen: SocketAddr,
}

impl Hello {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HELLO_BYTES);
        put_u32(&mut out, to_u32(self.rank));
        put_u32(&mut out, to_u32(self.world));
        put_u64(&mut out, self.host_id);
        put_u64(
            &mut out,
            u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
        );
        put_addr(&mut out, &self.listen);
        out
    }

    pub(super) fn decode(bytes: &[u8]) -> Option<Hello> {
        let mut r = Reader::new(bytes);
        let hello = Hello {
            rank: r.u32()? as usize,
            world: r.u32()? as usize,
            host_id: r.u64()?,
            timeout: Duration::from_millis(r.u64()?),
            listen: r.addr()?,
        };
        r.rest().is_empty().then_some(hello)
    }
}

/// One rank as the root's table describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Member {
    pub host_id: u64,
    pub listen: SocketAddr,
}

/// The root's one reply to every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Everyone arrived: one row per rank, index = rank.
    Table(Vec<Member>),
    /// The group cannot form; `kind` is InvalidArgument, Timeout or Remote.
    Refused { kind: ErrorKind, message: String },
}

impl Verdict {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Verdict::Table(members) => {
                out.push(REPLY_TABLE);
                for m in members {
                    put_u64(&mut out, m.host_id);
                    put_addr(&mut out, &m.listen);
                }
            }
            Verdict::Refused { kind, message } => {
                out.push(REPLY_ERROR);
                out.push(match kind {
                    ErrorKind::Timeout => 2,
                    ErrorKind::Remote => 3,
                    _ => 1,
                });
                let mut end = message.len().min(MAX_ERROR_TEXT);
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                out.extend_from_slice(&message.as_bytes()[..end]);
            }
        }
        out
    }

    /// Longest reply a rank of a `world`-rank group accepts.
    pub(super) fn max_len(world: usize) -> usize {
        1 + (world.saturating_mul(MEMBER_BYTES)).max(1 + MAX_ERROR_TEXT)
    }

    pub(super) fn decode(bytes: &[u8], world: usize) -> Option<Verdict> {
        let mut r = Reader::new(bytes);
        match r.u8()? {
            REPLY_TABLE => {
                let mut members = Vec::with_capacity(world);
                for _ in 0..world {
                    members.push(Member {
                        host_id: r.u64()?,
                        listen: r.addr()?,
                    });
                }
                r.rest().is_empty().then_some(Verdict::Table(members))
            }
            REPLY_ERROR => {
                let kind = match r.u8()? {
                    2 => ErrorKind::Timeout,
                    3 => ErrorKind::Remote,
                    _ => ErrorKind::InvalidArgument,
                };
                let message = String::from_utf8_lossy(r.rest()).into_owned();
                Some(Verdict::Refused { kind, message })
            }
            _ => None,
        }
    }
}

/// Prefixes a message with its length, the framing of the root protocol.
pub(super) fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + body.len());
    put_u32(&mut out, to_u32(body.len()));
    out.extend_from_slice(body);
    out
}

/// Compares two secrets without stopping at the first difference.
pub(super) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// FNV-1a, 64 bits: the id's checksum and the host id. Not cryptographic;
/// it only has to catch corruption and spread host names.
pub(super) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
