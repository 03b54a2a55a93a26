//! The host-side collectives a context needs while it is made and torn down:
//! agreeing on the configuration and barriers around the setup of the
//! symmetric buffers. Kernels never use them.
//!
//! Which transport carries them:
//! - contexts of `ep_ctx_create` use ep's bootstrap (TCP and Unix sockets
//!   between the ranks), also when they run on an NCCL communicator of
//!   their own;
//! - contexts of `ep_ctx_create_from_nccl` have no bootstrap: they use the
//!   caller's communicator ([`NcclGroup`]: `ncclAllGather` on a stream of the
//!   context, waited for with the context's timeout).

use super::bootstrap::Bootstrap;
use super::cuda::{check, Device, DeviceBuffer, OwnedStream};
use super::nccl::CommHandle;
use crate::error::{Error, ErrorKind, Result};
use cudarc::driver::sys;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The ranks of one context, as seen from one of them.
pub trait HostGroup: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Every rank's bytes, index = rank.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;
}

impl HostGroup for Bootstrap {
    fn rank(&self) -> usize {
        Bootstrap::rank(self)
    }

    fn world(&self) -> usize {
        Bootstrap::world(self)
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Bootstrap::all_gather(self, mine)
    }

    fn barrier(&self) -> Result<()> {
        Bootstrap::barrier(self)
    }
}

/// Host collectives over an NCCL communicator the context does not own.
pub struct NcclGroup {
    comm: Arc<CommHandle>,
    /// The context's own stream (on its device) for the collectives.
    stream: OwnedStream,
    rank: usize,
    world: usize,
    timeout: Duration,
    aborted: Arc<AtomicBool>,
}

// SAFETY: the communicator and stream are used by one thread at a time (the
// context's rule); the handles themselves are plain values.
unsafe impl Send for NcclGroup {}

impl NcclGroup {
    /// # Safety
    /// `comm` is a live communicator on `device` whose rank and size are
    /// `rank` and `world`.
    pub unsafe fn new(
        comm: Arc<CommHandle>,
        device: &Device,
        (rank, world): (usize, usize),
        timeout: Duration,
        aborted: Arc<AtomicBool>,
    ) -> Result<NcclGroup> {
        Ok(NcclGroup {
            comm,
            stream: OwnedStream::new(device)?,
            rank,
            world,
            timeout,
            aborted,
        })
    }

    /// Waits for the stream, giving up after the timeout or on abort.
    fn wait(&self, what: &str) -> Result<()> {
        let start = Instant::now();
        let _context = self.stream.device().bind()?;
        loop {
            // SAFETY: our own live stream.
            let res = unsafe { sys::cuStreamQuery(self.stream.raw()) };
            if res != sys::CUresult::CUDA_ERROR_NOT_READY {
                return check(res, what);
            }
            if self.aborted.load(Ordering::Acquire) {
                return Err(Error::new(
                    ErrorKind::Aborted,
                    format!("{what}: the context was aborted"),
                ));
            }
            if start.elapsed() > self.timeout {
                return Err(Error::timeout(format!(
                    "{what}: a rank of the NCCL communicator did not take part within {} ms",
                    self.timeout.as_millis()
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Every rank's `bytes` bytes, all ranks passing the same length.
    fn gather_fixed(&self, mine: &[u8]) -> Result<Vec<u8>> {
        let len = mine.len().max(1);
        let send = DeviceBuffer::new(self.stream.device(), len)?;
        let recv = DeviceBuffer::new(self.stream.device(), len * self.world)?;
        let mut padded = mine.to_vec();
        padded.resize(len, 0);
        let mut all = vec![0u8; len * self.world];
        // SAFETY: the buffers outlive the synchronous waits below, or are
        // leaked when a wait gives up with NCCL's work still queued.
        unsafe {
            send.copy_from_host_async(&padded, self.stream.raw())?;
            let _context = self.stream.device().bind()?;
            self.comm.nccl.all_gather(
                self.comm.comm,
                send.ptr(),
                recv.ptr(),
                len,
                self.stream.raw().cast(),
            )?;
        }
        if let Err(e) = self.wait("ncclAllGather") {
            std::mem::forget(send);
            std::mem::forget(recv);
            return Err(e);
        }
        // SAFETY: as above; the stream is idle.
        unsafe { recv.copy_to_host_async(&mut all, self.stream.raw())? };
        self.wait("copying the gathered bytes")?;
        Ok(all)
    }
}

impl HostGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        // Lengths first, so that ranks may pass different lengths.
        let lengths = self.gather_fixed(&(mine.len() as u64).to_le_bytes())?;
        let lengths: Vec<usize> = lengths
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
            .collect();
        let longest = *lengths.iter().max().unwrap_or(&0);
        let mut padded = mine.to_vec();
        padded.resize(longest, 0);
        let all = self.gather_fixed(&padded)?;
        let stride = longest.max(1);
        Ok(lengths
            .iter()
            .enumerate()
            .map(|(r, &len)| all[r * stride..r * stride + len].to_vec())
            .collect())
    }

    fn barrier(&self) -> Result<()> {
        self.gather_fixed(&[0]).map(|_| ())
    }
}
