//! The GPU backend: CUDA kernels on the caller's device and stream, ranks
//! connected over NVLink.
//!
//! Work runs on the device's primary context (never created, replaced or
//! destroyed here); every call pushes it and pops it again, so the caller's
//! current context is left as it was. Kernels report failures (a timed-out
//! wait, an invalid expert id) in a status word in host-mapped memory, which
//! [`GpuMonitor`] reads from any thread.
//!
//! Several ranks may share one GPU when they are threads of one process
//! (see [`placement`]): each gets a share of the SMs, and each must pass its
//! own stream.

mod checks;
mod low_latency;
mod mega;
mod normal;
mod placement;
mod symmetric;

use super::backend::{Backend, HandleState, Inputs, Monitor, Stream};
use super::bootstrap::Bootstrap;
use super::config::{agree_on_config, Config};
use super::contract::{Field, Memory, PointerCheck};
use super::cuda::{
    ContextGuard, Device, DeviceStatus, Kernel, MappedHost, Module, KERNEL_IMAGES, STREAM_LEGACY,
};
use super::log;
use super::ops::{
    CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp, MegaCombineOp, MegaDispatchOp,
    Received,
};
use super::sequence::Call;
use crate::abi::{
    self, BarrierParams, CombineParams, DispatchParams, LayoutParams, LlParams, MegaParams,
    BARRIER_COUNTER_OFFSET, BARRIER_THREADS,
};
use crate::error::{Error, Result};
use low_latency::LlMode;
use mega::MegaMode;
use normal::NormalMode;
use placement::Placement;
use std::ffi::c_void;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use symmetric::SymmetricMemory;

/// Bytes at the start of every rank's buffer for cross-rank signals of the
/// runtime itself, before the modes' areas: the barrier's `[world]` slots at
/// offset 0 (so the table of peer buffers is also the barrier's table of
/// peer slot arrays), then this rank's barrier counts (entered, passed) at
/// `BARRIER_COUNTER_OFFSET` and its call words at `CALL_WORDS_OFFSET`.
const SIGNAL_BYTES: usize = 64 * 1024;

/// Every kernel of the library, looked up once when a context loads the
/// module, each typed by its parameter struct.
pub struct Kernels {
    pub layout: Kernel<LayoutParams>,
    pub barrier: Kernel<BarrierParams>,
    pub dispatch_count: Kernel<DispatchParams>,
    pub dispatch_stage: Kernel<DispatchParams>,
    pub dispatch_pull: Kernel<DispatchParams>,
    pub combine_send: Kernel<CombineParams>,
    pub combine_reduce: Kernel<CombineParams>,
    pub ll_dispatch: Kernel<LlParams>,
    pub ll_combine: Kernel<LlParams>,
    pub mega_bf16: Kernel<MegaParams>,
    pub mega_fp8: Kernel<MegaParams>,
    pub mega_bf16_pair: Kernel<MegaParams>,
    pub mega_fp8_pair: Kernel<MegaParams>,
}

impl Kernels {
    fn load(module: &Module) -> Result<Kernels> {
        Ok(Kernels {
            layout: module.function(c"ep_layout_kernel")?,
            barrier: module.function(c"ep_barrier_kernel")?,
            dispatch_count: module.function(c"ep_dispatch_count_kernel")?,
            dispatch_stage: module.function(c"ep_dispatch_stage_kernel")?,
            dispatch_pull: module.function(c"ep_dispatch_pull_kernel")?,
            combine_send: module.function(c"ep_combine_send_kernel")?,
            combine_reduce: module.function(c"ep_combine_reduce_kernel")?,
            ll_dispatch: module.function(c"ep_ll_dispatch_kernel")?,
            ll_combine: module.function(c"ep_ll_combine_kernel")?,
            mega_bf16: module.function(c"ep_mega_bf16_kernel")?,
            mega_fp8: module.function(c"ep_mega_fp8_kernel")?,
            mega_bf16_pair: module.function(c"ep_mega_bf16_pair_kernel")?,
            mega_fp8_pair: module.function(c"ep_mega_fp8_pair_kernel")?,
        })
    }
}

pub fn create(cfg: &Config, unique_id: &[u8; 128]) -> Result<(Box<dyn Backend>, Arc<dyn Monitor>)> {
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
    agree_on_config(&boot, cfg)?;
    let placement = Placement::exchange(&device, &boot)?;
    let module = Module::load(&device)?;
    let kernels = Kernels::load(&module)?;
    log_summary(cfg, &device, &module);
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
        kernels,
        boot,
        memory,
        monitor: monitor.clone(),
        timeout_ns: cfg.timeout.as_nanos() as u64,
        placement,
    };
    let normal = NormalMode::new(&rt, SIGNAL_BYTES)?;
    let ll = LlMode::new(&rt, SIGNAL_BYTES + normal::buffer_bytes(cfg))?;
    let mega = MegaMode::new(&rt)?;
    // No rank returns (and enqueues a collective) before every rank has
    // made its allocations: on a GPU that ranks share, an allocation could
    // otherwise wait for a peer's kernel that waits for this rank.
    rt.boot.barrier()?;
    Ok((
        Box::new(GpuBackend {
            rt,
            normal,
            ll,
            mega,
        }),
        monitor,
    ))
}

/// The INFO lines of a new GPU context: the device, the kernels loaded and
/// what the buffers are made of.
fn log_summary(cfg: &Config, device: &Device, module: &Module) {
    if !log::enabled(log::Level::Info) {
        return;
    }
    let unknown = |e: Error| format!("unknown ({})", e.message);
    let name = device.name().unwrap_or_else(unknown);
    let sms = device.sm_count().map_or_else(unknown, |n| n.to_string());
    let arch = device
        .compute_capability()
        .map_or_else(unknown, |(major, minor)| format!("sm_{major}{minor}"));
    log::info!(
        "GPU backend: device {} = {name}, {arch}, {sms} SMs; normal-mode kernels use {} SMs",
        cfg.device,
        cfg.num_sms
    );
    match module.kernel_names() {
        Ok(names) => log::info!(
            "kernels: {} loaded from {} embedded fatbins ({}): {}",
            names.len(),
            KERNEL_IMAGES.len(),
            log::human_bytes(KERNEL_IMAGES.iter().map(|(_, image)| image.0.len()).sum()),
            names.join(", ")
        ),
        Err(e) => log::info!("kernels: loaded (cannot list them: {})", e.message),
    }
    log::info!(
        "buffer: {} per rank = signals {} + normal mode {} (max_tokens_per_rank {}, hidden {}, topk {}, token_dtype {}, world {}) + low-latency mode {} (ll_max_tokens_per_rank {}, {} local experts)",
        log::human_bytes(buffer_bytes(cfg)),
        log::human_bytes(SIGNAL_BYTES),
        log::human_bytes(normal::buffer_bytes(cfg)),
        cfg.max_tokens,
        cfg.topo.hidden,
        cfg.topo.topk,
        super::describe::dtype(cfg.token_dtype),
        cfg.world(),
        log::human_bytes(low_latency::buffer_bytes(cfg)),
        cfg.ll_max_tokens,
        cfg.local_experts()
    );
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
        if status.code == abi::STATUS_OK {
            status.code = abi::STATUS_ABORTED;
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
    /// Keeps the kernels' code loaded; `kernels` are its functions.
    pub module: Module,
    pub kernels: Kernels,
    pub boot: Bootstrap,
    pub memory: SymmetricMemory,
    pub monitor: Arc<GpuMonitor>,
    /// Longest device-side wait, in nanoseconds of `%globaltimer`.
    pub timeout_ns: u64,
    /// The ranks on this rank's GPU and the share of its SMs this rank gets.
    pub placement: Placement,
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

    /// Makes the device's context current for one API call: every launch
    /// goes through the returned [`Bound`], and the caller's context is
    /// restored when it is dropped.
    pub fn bind(&self) -> Result<Bound<'_>> {
        Ok(Bound {
            rt: self,
            _guard: self.device.bind()?,
        })
    }

    /// Blocks of the normal-mode kernels that move rows: the config's SM
    /// budget, at most this rank's share of the GPU.
    pub fn normal_grid(&self) -> u32 {
        (self.cfg.num_sms as u32).min(self.placement.sm_share())
    }

    /// Waits for `stream`, then reports any error a kernel recorded.
    pub fn synchronize(&self, stream: Stream) -> Result<()> {
        // SAFETY: the caller's stream of this device (API rule).
        unsafe { self.device.stream_synchronize(stream as _)? };
        self.monitor.async_error()
    }
}

/// The runtime with its device's context current on this thread, for the
/// duration of one API call: the only way to launch a kernel.
pub struct Bound<'a> {
    rt: &'a Runtime,
    _guard: ContextGuard<'a>,
}

impl Deref for Bound<'_> {
    type Target = Runtime;
    fn deref(&self) -> &Runtime {
        self.rt
    }
}

impl Bound<'_> {
    /// Launches `kernel` on `stream` (see `Kernel::launch`).
    ///
    /// # Safety
    /// Every pointer in `params` must stay valid until the kernel has
    /// finished.
    pub unsafe fn launch<P>(
        &self,
        kernel: &Kernel<P>,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        stream: Stream,
        params: &P,
    ) -> Result<()> {
        // SAFETY: the runtime keeps the module loaded; the caller vouches
        // for the pointers.
        unsafe { kernel.launch(&self._guard, grid, block, shared_bytes, stream as _, params) }
    }

    /// Launches `kernel` cooperatively on `stream` (see
    /// `Kernel::launch_cooperative`): for kernels whose blocks wait for
    /// each other.
    ///
    /// # Safety
    /// As for `launch`.
    pub unsafe fn launch_cooperative<P>(
        &self,
        kernel: &Kernel<P>,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        stream: Stream,
        params: &P,
    ) -> Result<()> {
        // SAFETY: as in `launch`.
        unsafe {
            kernel.launch_cooperative(&self._guard, grid, block, shared_bytes, stream as _, params)
        }
    }

    /// Blocks of `kernel` that fit on one SM at once (see
    /// `Kernel::max_blocks_per_sm`).
    pub fn max_blocks_per_sm<P>(
        &self,
        kernel: &Kernel<P>,
        block: u32,
        shared_bytes: u32,
    ) -> Result<u32> {
        kernel.max_blocks_per_sm(&self._guard, block, shared_bytes)
    }

    /// Enqueues a barrier of all ranks on `stream`: work enqueued after it
    /// sees every write any rank enqueued before it (see kernels/barrier.cu).
    ///
    /// # Safety
    /// `stream` must be a stream of this context's device (or null).
    pub unsafe fn barrier(&self, stream: Stream) -> Result<()> {
        let params = BarrierParams {
            peer_signals: self.memory.peer_bases(),
            epoch_counter: self.memory.base(self.cfg.rank) + BARRIER_COUNTER_OFFSET as u64,
            abort_flag: self.abort_ptr(),
            status: self.status_ptr(),
            timeout_ns: self.timeout_ns,
            rank: self.cfg.rank as i32,
            world: self.cfg.world() as i32,
        };
        // SAFETY: the context's own buffers and words.
        unsafe {
            self.launch(
                &self.kernels.barrier,
                1,
                BARRIER_THREADS as u32,
                0,
                stream,
                &params,
            )
        }
    }
}

/// A device pointer kernel argument: 0 for "not given".
pub fn ptr<T>(p: *const T) -> u64 {
    p as u64
}

/// Alignment of every token-row array: the kernels move rows as 16-byte
/// vectors.
const ROW_ALIGNMENT: usize = 16;

struct GpuBackend {
    rt: Runtime,
    normal: NormalMode,
    ll: LlMode,
    mega: MegaMode,
}

impl PointerCheck for GpuBackend {
    fn check_pointer(&self, field: &Field, ptr: *const c_void) -> Result<()> {
        if field.rows && !(ptr as usize).is_multiple_of(ROW_ALIGNMENT) {
            return Err(Error::invalid(format!(
                "`{}` = {ptr:p} is not {ROW_ALIGNMENT}-byte aligned (the GPU backend moves rows as {ROW_ALIGNMENT}-byte vectors)",
                field.name
            )));
        }
        match field.memory {
            Memory::Device => checks::device_memory(&self.rt.device, field, ptr),
            Memory::Host => Ok(()),
        }
    }
}

impl Backend for GpuBackend {
    fn check_stream(&self, stream: Stream) -> Result<()> {
        // Ranks that share a GPU must each use their own stream: on the
        // legacy default stream (NULL or `CU_STREAM_LEGACY`) their kernels
        // would run one after the other, and a kernel waiting for a peer's
        // would wait for its own successor, until the timeout.
        let legacy = stream.is_null() || stream as usize == STREAM_LEGACY;
        let sharing = &self.rt.placement.sharing;
        if legacy && sharing.len() > 1 {
            let ranks: Vec<String> = sharing.iter().map(|r| r.to_string()).collect();
            return Err(Error::invalid(format!(
                "ranks {} share this GPU, so each must pass its own stream: on the legacy \
                 default stream (NULL) their kernels would run one after the other and wait \
                 for each other until the timeout (use a stream created with \
                 CU_STREAM_NON_BLOCKING, or CU_STREAM_PER_THREAD)",
                ranks.join(", ")
            )));
        }
        checks::stream(&self.rt.device, stream)
    }

    /// The caller's arrays are device memory: their contents are checked by
    /// the kernels, which report errors through the async status.
    fn check_inputs(&mut self, _inputs: Inputs<'_>) -> Result<()> {
        Ok(())
    }

    fn layout(&mut self, op: &LayoutOp, stream: Stream) -> Result<()> {
        self.normal.layout(&self.rt.bind()?, op, stream)
    }

    fn new_handle_state(&mut self) -> Result<HandleState> {
        self.normal.new_handle_state(&self.rt)
    }

    // The collective calls pass their operation's code to the kernels,
    // which number the calls on the device (kernels/include/ep_device.cuh,
    // "Collective calls"; the numbers agree with `call.number` for calls
    // made directly, and go on counting in CUDA-graph replays).

    fn dispatch(
        &mut self,
        call: Call,
        op: &DispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<Option<Received>> {
        self.normal
            .dispatch(&self.rt.bind()?, call, op, handle, stream)
    }

    fn combine(
        &mut self,
        call: Call,
        op: &CombineOp,
        handle: &HandleState,
        stream: Stream,
    ) -> Result<()> {
        self.normal
            .combine(&self.rt.bind()?, call, op, handle, stream)
    }

    fn check_fused(&self) -> Result<()> {
        self.mega.check_supported()
    }

    fn mega_dispatch_gemm(
        &mut self,
        call: Call,
        op: &MegaDispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()> {
        self.mega
            .dispatch_gemm(&self.rt.bind()?, &self.normal, call, op, handle, stream)
    }

    fn mega_gemm_combine(
        &mut self,
        call: Call,
        op: &MegaCombineOp,
        handle: &HandleState,
        stream: Stream,
    ) -> Result<()> {
        self.mega
            .gemm_combine(&self.rt.bind()?, &self.normal, call, op, handle, stream)
    }

    fn ll_dispatch(&mut self, call: Call, op: &LlDispatchOp, stream: Stream) -> Result<()> {
        self.ll.dispatch(&self.rt.bind()?, call, op, stream)
    }

    fn ll_combine(&mut self, call: Call, op: &LlCombineOp, stream: Stream) -> Result<()> {
        self.ll.combine(&self.rt.bind()?, call, op, stream)
    }

    fn ll_combine_buffer(&mut self) -> Result<(*mut u8, usize)> {
        self.ll.combine_buffer(&self.rt)
    }
}
