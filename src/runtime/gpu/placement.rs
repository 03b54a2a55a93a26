//! Which ranks share this rank's GPU, and the share of its SMs each gets.
//!
//! Ranks that are threads of one process may name the same device. Their
//! kernels then run at the same time on different streams of one GPU, and
//! a kernel that waits for a peer's kernel (the barrier, the low-latency
//! kernels) only finishes if the peer's kernel runs too. So each rank gets
//! `SMs / ranks on the device` SMs (its *share*): the low-latency grid is
//! one block per SM of the share, the normal-mode grids are at most the
//! share, and the grids of all ranks on the GPU fit on it together (the
//! argument is in kernels/low_latency.cu, "Co-residency").
//!
//! Ranks in different processes cannot share a GPU: without MPS the
//! kernels of two processes do not run at the same time, so their waits
//! could only end in a timeout. Every rank learns where every other rank
//! runs (GPU UUID and a token of its process, all-gathered at create), so
//! all of them refuse such a group with the same `EP_ERR_UNSUPPORTED`.

use super::super::cuda::Device;
use super::super::group::HostGroup;
use crate::error::{Error, Result};
use std::sync::OnceLock;

/// Bytes each rank sends: GPU UUID (16), process token (8), SMs (4),
/// device ordinal (4).
const RECORD_BYTES: usize = 32;

/// Where one rank runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Site {
    uuid: [u8; 16],
    process: u64,
    sms: u32,
    ordinal: u32,
}

impl Site {
    fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut out = [0; RECORD_BYTES];
        out[..16].copy_from_slice(&self.uuid);
        out[16..24].copy_from_slice(&self.process.to_le_bytes());
        out[24..28].copy_from_slice(&self.sms.to_le_bytes());
        out[28..32].copy_from_slice(&self.ordinal.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Site> {
        if bytes.len() != RECORD_BYTES {
            return None;
        }
        Some(Site {
            uuid: bytes[..16].try_into().ok()?,
            process: u64::from_le_bytes(bytes[16..24].try_into().ok()?),
            sms: u32::from_le_bytes(bytes[24..28].try_into().ok()?),
            ordinal: u32::from_le_bytes(bytes[28..32].try_into().ok()?),
        })
    }
}

/// A random number that stands for this process (process ids repeat
/// across PID namespaces, this does not).
fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        let mut bytes = [0u8; 8];
        // SAFETY: writes at most 8 bytes into `bytes`.
        let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), 8, 0) };
        if n == 8 {
            u64::from_le_bytes(bytes)
        } else {
            // No getrandom: the pid and the clock tell processes apart on
            // one host as well.
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            nanos ^ (u64::from(std::process::id()) << 32)
        }
    })
}

/// This rank's place: the ranks on its GPU and the GPU's SMs.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Ranks on this rank's GPU, ascending, this one included.
    pub sharing: Vec<usize>,
    /// Streaming multiprocessors of the GPU.
    pub sms: u32,
}

impl Placement {
    /// Learns where every rank runs (collective: every rank calls it once,
    /// at create). Every rank reaches the same verdict.
    ///
    /// Errors: `Unsupported` when ranks of different processes name one GPU,
    /// or more ranks share a GPU than it has SMs; `Remote` for a malformed
    /// record from a peer.
    pub fn exchange(device: &Device, boot: &dyn HostGroup) -> Result<Placement> {
        let mine = Site {
            uuid: device.uuid()?,
            process: process_token(),
            sms: device.sm_count()?,
            ordinal: device.ordinal() as u32,
        };
        let sites = boot
            .all_gather(&mine.encode())?
            .iter()
            .enumerate()
            .map(|(rank, bytes)| {
                Site::decode(bytes).ok_or_else(|| {
                    Error::remote(format!("rank {rank} sent a malformed GPU record"))
                })
            })
            .collect::<Result<Vec<Site>>>()?;
        Self::from_sites(&sites, boot.rank())
    }

    fn from_sites(sites: &[Site], rank: usize) -> Result<Placement> {
        for (a, site) in sites.iter().enumerate() {
            let group: Vec<usize> = (0..sites.len())
                .filter(|&b| sites[b].uuid == site.uuid)
                .collect();
            if let Some(&b) = group.iter().find(|&&b| sites[b].process != site.process) {
                return Err(Error::unsupported(format!(
                    "ranks {a} and {b} use the same GPU (device {} of rank {a}) from different \
                     processes: ranks that share a GPU must be threads of one process \
                     (processes would need MPS)",
                    site.ordinal
                )));
            }
            if group.len() > site.sms as usize {
                return Err(Error::unsupported(format!(
                    "{} ranks share one GPU (device {} of rank {a}), which has only {} SMs: \
                     each rank needs at least one",
                    group.len(),
                    site.ordinal,
                    site.sms
                )));
            }
        }
        let me = sites[rank];
        Ok(Placement {
            sharing: (0..sites.len())
                .filter(|&r| sites[r].uuid == me.uuid)
                .collect(),
            sms: me.sms,
        })
    }

    /// Whether other ranks run on this rank's GPU too.
    pub fn shared(&self) -> bool {
        self.sharing.len() > 1
    }

    /// SMs this rank's kernels may fill: the GPU's SMs divided by the ranks
    /// on it (at least 1).
    pub fn sm_share(&self) -> u32 {
        (self.sms / self.sharing.len() as u32).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(gpu: u8, process: u64) -> Site {
        Site {
            uuid: [gpu; 16],
            process,
            sms: 132,
            ordinal: gpu as u32,
        }
    }

    #[test]
    fn records_round_trip() {
        let s = site(3, 0xdead_beef_1234);
        assert_eq!(Site::decode(&s.encode()), Some(s));
        assert_eq!(Site::decode(&[0; 5]), None);
    }

    #[test]
    fn ranks_on_one_gpu_share_its_sms() {
        // Ranks 0, 2 and 3 on GPU 0, rank 1 alone on GPU 1; one process.
        let sites = [site(0, 7), site(1, 7), site(0, 7), site(0, 7)];
        let p = Placement::from_sites(&sites, 2).unwrap();
        assert_eq!(p.sharing, [0, 2, 3]);
        assert!(p.shared());
        assert_eq!(p.sm_share(), 44);
        let alone = Placement::from_sites(&sites, 1).unwrap();
        assert_eq!(alone.sharing, [1]);
        assert!(!alone.shared());
        assert_eq!(alone.sm_share(), 132);
    }

    #[test]
    fn processes_on_one_gpu_are_refused_on_every_rank() {
        // Ranks 2 and 3 are processes on GPU 1; rank 0 learns it too.
        let sites = [site(0, 1), site(0, 1), site(1, 2), site(1, 3)];
        for rank in 0..4 {
            let err = Placement::from_sites(&sites, rank).unwrap_err();
            assert_eq!(err.kind, crate::error::ErrorKind::Unsupported);
            assert!(err.message.contains("ranks 2 and 3"), "{}", err.message);
            assert!(err.message.contains("MPS"), "{}", err.message);
        }
    }

    #[test]
    fn more_ranks_than_sms_are_refused() {
        let mut sites = vec![site(0, 1); 3];
        for s in &mut sites {
            s.sms = 2;
        }
        let err = Placement::from_sites(&sites, 0).unwrap_err();
        assert!(err.message.contains("only 2 SMs"), "{}", err.message);
    }

    #[test]
    fn the_process_token_is_stable() {
        assert_eq!(process_token(), process_token());
    }
}
