//! The GPU backend: CUDA kernels on the caller's device and stream, ranks
//! connected over NVLink.
//!
//! Work runs on the device's primary context (never created, replaced or
//! destroyed here); every call pushes it and pops it again, so the caller's
//! current context is left as it was. Kernels report failures (a timed-out
//! wait, an invalid expert id) in a status word in host-mapped memory, which
//! [`GpuMonitor`] reads from any thread.

mod low_latency;
mod normal;
mod symmetric;

use super::backend::{Backend, HandleState, Monitor, Stream};
use super::bootstrap::Bootstrap;
use super::config::{agree_on_config, Config, MAX_WORLD_SIZE};
use super::cuda::{Device, DeviceStatus, MappedHost, Module};
use super::ops::{CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp};
use crate::error::{Error, Result};
use low_latency::LlMode;
use normal::NormalMode;
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use symmetric::SymmetricMemory;

/// Bytes at the start of every rank's buffer for cross-rank signals of the
/// runtime itself, before the modes' areas: the barrier's `[world]` slots at
/// offset 0 (so the table of peer buffers is also the barrier's table of
/// peer slot arrays), then this rank's barrier counts (entered, passed).
const SIGNAL_BYTES: usize = 64 * 1024;
/// Mirrors `EP_BARRIER_COUNTER_OFFSET` in kernels/include/ep_device.cuh.
const BARRIER_COUNTER_OFFSET: usize = MAX_WORLD_SIZE * 4;

/// Threads of the barrier kernel's one block: one per rank.
const BARRIER_THREADS: u32 = MAX_WORLD_SIZE as u32;

pub fn create(
    cfg: &mut Config,
    unique_id: &[u8; 128],
) -> Result<(Box<dyn Backend>, Arc<dyn Monitor>)> {
    // Probe the driver before joining, so a machine without a GPU fails at
    // once with `CudaUnavailable`.
    let device = Device::new(cfg.device as usize)?;
    let aborted = Arc::new(AtomicBool::new(false));
    let boot = Bootstrap::connect(
        unique_id,
        cfg.rank,
        cfg.world(),
        cfg.timeout,
        aborted.clone(),
    )?;
    cfg.resolve_nodes(boot.local_ranks())?;
    agree_on_config(&boot, cfg)?;
    if cfg.nodes().is_hierarchical() {
        return Err(Error::unsupported(
            "several nodes (ranks_per_node below the world size) need the hierarchical GPU modes, which this build does not have yet",
        ));
    }
    let module = Module::load(&device)?;
    let memory = SymmetricMemory::new(&device, &boot, buffer_bytes(cfg))?;
    let monitor = Arc::new(GpuMonitor {
        status: MappedHost::new(&device, 1)?,
        abort_flag: MappedHost::new(&device, 1)?,
        aborted,
    });
    let rt = Runtime {
        cfg: *cfg,
        device,
        module,
        boot,
        memory,
        monitor: monitor.clone(),
        timeout_ns: cfg.timeout.as_nanos() as u64,
    };
    let normal = NormalMode::new(&rt, SIGNAL_BYTES)?;
    let ll = LlMode::new(&rt, SIGNAL_BYTES + normal::buffer_bytes(cfg))?;
    Ok((Box::new(GpuBackend { rt, normal, ll }), monitor))
}

/// Bytes of communication buffer one rank allocates for `cfg`.
pub fn buffer_bytes(cfg: &Config) -> usize {
    SIGNAL_BYTES + normal::buffer_bytes(cfg) + low_latency::buffer_bytes(cfg)
}

/// The host-mapped words the kernels and any host thread share.
pub struct GpuMonitor {
    /// First error recorded by a kernel of this context.
    status: MappedHost<DeviceStatus>,
    /// Non-zero tells waiting kernels to give up.
    abort_flag: MappedHost<i32>,
    /// Tells host-side waits (bootstrap) to give up.
    aborted: Arc<AtomicBool>,
}

impl Monitor for GpuMonitor {
    fn async_error(&self) -> Result<()> {
        self.status.read(0).to_result()
    }

    fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        self.abort_flag.write(0, 1);
        let mut status = self.status.read(0);
        if status.code == DeviceStatus::OK {
            status.code = DeviceStatus::ABORTED;
            status.rank = -1;
            self.status.write(0, status);
        }
    }
}

/// What every mode's kernels need: the device, the loaded kernels, the
/// symmetric buffers, and the status and abort words.
pub struct Runtime {
    pub cfg: Config,
    pub device: Device,
    pub module: Module,
    pub boot: Bootstrap,
    pub memory: SymmetricMemory,
    pub monitor: Arc<GpuMonitor>,
    /// Longest device-side wait, in nanoseconds of `%globaltimer`.
    pub timeout_ns: u64,
}

impl Runtime {
    /// Device pointer to the status word kernels report errors into.
    pub fn status_ptr(&self) -> u64 {
        self.monitor.status.device_ptr()
    }

    /// Device pointer to the abort flag every device wait polls.
    pub fn abort_ptr(&self) -> u64 {
        self.monitor.abort_flag.device_ptr()
    }

    /// Launches kernel `name` on `stream` (see `Kernel::launch`).
    ///
    /// # Safety
    /// `params` must match the kernel's signature, and every pointer passed
    /// must stay valid until the kernel has finished.
    pub unsafe fn launch(
        &self,
        name: &str,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let kernel = self.module.function(name)?;
        kernel.launch(grid, block, shared_bytes, stream as _, params)
    }

    /// Enqueues a barrier of all ranks on `stream`: work enqueued after it
    /// sees every write any rank enqueued before it (see kernels/barrier.cu).
    ///
    /// # Safety
    /// `stream` must be a stream of this context's device (or null).
    pub unsafe fn barrier(&self, stream: Stream) -> Result<()> {
        let rank = self.cfg.rank;
        let mut peer_slots = self.memory.peer_bases();
        let mut rank_arg = rank as i32;
        let mut world = self.cfg.world() as i32;
        let mut counter = self.memory.base(rank) + BARRIER_COUNTER_OFFSET as u64;
        let mut timeout_ns = self.timeout_ns;
        let mut abort = self.abort_ptr();
        let mut status = self.status_ptr();
        let mut params = [
            arg(&mut peer_slots),
            arg(&mut rank_arg),
            arg(&mut world),
            arg(&mut counter),
            arg(&mut timeout_ns),
            arg(&mut abort),
            arg(&mut status),
        ];
        // SAFETY: the parameters match the kernel's signature; the buffers
        // belong to the context.
        unsafe {
            self.launch(
                "ep_barrier_kernel",
                1,
                BARRIER_THREADS,
                0,
                stream,
                &mut params,
            )
        }
    }

    /// Waits for `stream`, then reports any error a kernel recorded.
    pub fn synchronize(&self, stream: Stream) -> Result<()> {
        // SAFETY: the caller's stream of this device (API rule).
        unsafe { self.device.stream_synchronize(stream as _)? };
        self.monitor.async_error()
    }
}

/// A device pointer kernel argument: 0 for "not given".
pub fn ptr<T>(p: *const T) -> u64 {
    p as u64
}

/// Checks that a caller's row array is 16-byte aligned: the kernels move
/// rows as 16-byte vectors.
pub fn check_aligned<T>(name: &str, p: *const T) -> Result<()> {
    if !(p as usize).is_multiple_of(16) {
        return Err(Error::invalid(format!(
            "{name} = {p:p} is not 16-byte aligned (the GPU backend moves rows as 16-byte vectors)"
        )));
    }
    Ok(())
}

/// A kernel parameter: the address of the value, as `cuLaunchKernel` takes it.
pub fn arg<T>(value: &mut T) -> *mut c_void {
    value as *mut T as *mut c_void
}

struct GpuBackend {
    rt: Runtime,
    normal: NormalMode,
    ll: LlMode,
}

impl Backend for GpuBackend {
    fn layout(&mut self, op: &LayoutOp, stream: Stream) -> Result<()> {
        self.normal.layout(&self.rt, op, stream)
    }

    fn new_handle_state(&mut self) -> Result<HandleState> {
        self.normal.new_handle_state(&self.rt)
    }

    fn dispatch(
        &mut self,
        op: &DispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()> {
        self.normal.dispatch(&self.rt, op, handle, stream)
    }

    fn combine(&mut self, op: &CombineOp, handle: &HandleState, stream: Stream) -> Result<()> {
        self.normal.combine(&self.rt, op, handle, stream)
    }

    fn ll_dispatch(&mut self, op: &LlDispatchOp, stream: Stream) -> Result<()> {
        self.ll.dispatch(&self.rt, op, stream)
    }

    fn ll_combine(&mut self, op: &LlCombineOp, stream: Stream) -> Result<()> {
        self.ll.combine(&self.rt, op, stream)
    }

    fn ll_combine_buffer(&mut self) -> Result<(*mut u8, usize)> {
        self.ll.combine_buffer(&self.rt)
    }
}
