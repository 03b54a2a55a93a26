//! The 128-byte unique id, randomness, and the host id.
//!
//! Id layout (integers little-endian):
//!
//! | bytes    | field                                         |
//! |----------|-----------------------------------------------|
//! | 0..4     | magic `EPid`                                  |
//! | 4..6     | format version                                |
//! | 6..8     | zero                                          |
//! | 8..32    | the root's address and port ([`ADDR_BYTES`])  |
//! | 32..64   | the secret                                    |
//! | 64..72   | the session id                                |
//! | 72..120  | zero                                          |
//! | 120..128 | FNV-1a of bytes 0..120                        |

use std::io::Read;
use std::net::SocketAddr;

use super::wire::{fnv1a, put_addr, put_u64, Reader, ADDR_BYTES, SECRET_BYTES};
use super::UNIQUE_ID_BYTES;
use crate::error::{Error, Result};

const MAGIC: [u8; 4] = *b"EPid";
const VERSION: u16 = 1;
const CHECKSUM_AT: usize = UNIQUE_ID_BYTES - 8;

/// The decoded unique id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct UniqueId {
    /// Where the rendezvous root listens.
    pub root: SocketAddr,
    /// Opens every connection of this group, to the root and between ranks.
    pub secret: [u8; SECRET_BYTES],
    /// Names this group's Unix sockets, so concurrent groups on one host do
    /// not collide.
    pub session: u64,
}

impl UniqueId {
    /// A fresh secret and session id for a root listening at `root`.
    pub(super) fn generate(root: SocketAddr) -> Result<UniqueId> {
        let mut secret = [0u8; SECRET_BYTES];
        random_bytes(&mut secret)?;
        let mut session = [0u8; 8];
        random_bytes(&mut session)?;
        Ok(UniqueId {
            root,
            secret,
            session: u64::from_le_bytes(session),
        })
    }

    pub(super) fn encode(&self) -> [u8; UNIQUE_ID_BYTES] {
        let mut out = Vec::with_capacity(UNIQUE_ID_BYTES);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        put_addr(&mut out, &self.root);
        out.extend_from_slice(&self.secret);
        put_u64(&mut out, self.session);
        out.resize(CHECKSUM_AT, 0);
        let sum = fnv1a(&[&out]);
        put_u64(&mut out, sum);
        let mut id = [0u8; UNIQUE_ID_BYTES];
        id.copy_from_slice(&out);
        id
    }

    pub(super) fn decode(id: &[u8; UNIQUE_ID_BYTES]) -> Result<UniqueId> {
        let not_ours = |why: &str| Error::invalid(format!("not an ep unique id ({why})"));
        let (body, sum) = id.split_at(CHECKSUM_AT);
        let mut r = Reader::new(body);
        if r.array::<4>() != Some(MAGIC) {
            return Err(not_ours("wrong magic"));
        }
        if Some(fnv1a(&[body])) != Reader::new(sum).u64() {
            return Err(not_ours("checksum mismatch"));
        }
        let version = r.u16().unwrap_or(0);
        if version != VERSION {
            return Err(Error::invalid(format!(
                "not an ep unique id of this version (format {version}, this library reads {VERSION})"
            )));
        }
        let _reserved = r.u16();
        let fields = (|| {
            let root = r.addr()?;
            let secret = r.array::<SECRET_BYTES>()?;
            let session = r.u64()?;
            Some(UniqueId {
                root,
                secret,
                session,
            })
        })();
        fields.ok_or_else(|| not_ours("bad root address"))
    }
}

// The layout above must fit: header, address, secret and session before the checksum.
const _: () = assert!(8 + ADDR_BYTES + SECRET_BYTES + 8 <= CHECKSUM_AT);

/// Fills `buf` from the kernel's random source (getrandom(2)).
pub(super) fn random_bytes(buf: &mut [u8]) -> Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: the pointer and length describe `rest`, which we own mutably.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::system("getrandom", err));
        }
        filled += n as usize;
    }
    Ok(())
}

/// Identifies the machine (more exactly: this boot of this kernel under this
/// host name), so ranks can tell which peers share it. Two containers with
/// different host names count as different hosts, which is what we want:
/// they usually cannot reach each other's abstract Unix sockets.
pub(super) fn host_id() -> u64 {
    let mut name = [0u8; 256];
    // SAFETY: the buffer is writable for its full length; gethostname writes
    // at most that many bytes.
    let rc = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    let name = if rc == 0 {
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        &name[..end]
    } else {
        &[][..]
    };
    let mut boot_id = Vec::new();
    if let Ok(mut f) = std::fs::File::open("/proc/sys/kernel/random/boot_id") {
        // An unreadable boot id leaves the host name alone to decide.
        let _ = f.by_ref().take(64).read_to_end(&mut boot_id);
    }
    fnv1a(&[name, &[0], boot_id.trim_ascii()])
}
