//! The GPU backend: CUDA kernels on the caller's device and stream, ranks
//! connected over NVLink.
//!
//! A context is made by `ep_ctx_create` (ep's bootstrap; symmetric memory of
//! its own on one host, or, with ranks on several hosts or
//! `EP_TRANSPORT=nccl`, an NCCL communicator of its own made from an
//! `ncclUniqueId` the bootstrap carries) or by `ep_ctx_create_from_nccl` on
//! the caller's communicator. Either way the modes see one
//! [`SymmetricMemory`] (see `symmetric.rs`).
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
mod hierarchical;
mod low_latency;
mod mega;
mod moe;
mod normal;
mod placement;
mod symmetric;

use super::backend::{Backend, HandleState, Inputs, LlTimeline, Monitor, Stream};
use super::bootstrap::Bootstrap;
use super::config::Config;
use super::contract::{Field, Memory, PointerCheck};
use super::cuda::{
    self, ContextGuard, Device, DeviceStatus, Kernel, LaunchOrder, MappedHost, Module, OwnedStream,
    KERNEL_IMAGES, STREAM_LEGACY,
};
use super::group::{HostGroup, NcclGroup};
use super::log;
use super::nccl::{self, CommHandle, UniqueId};
use super::ops::{
    CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp, MegaCombineOp, MegaDispatchOp,
    MoeOp, Received,
};
use super::sequence::{Call, Collective};
use crate::abi::{
    self, BarrierParams, CombineParams, DispatchParams, HierParams, LayoutParams, LlParams,
    MoeParams, NcclPeerBasesParams, BARRIER_COUNTER_OFFSET, BARRIER_PLAIN, BARRIER_THREADS,
    EXCHANGE_NONE, OPEN_EXCHANGE_OFFSET,
};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use low_latency::LlMode;
use mega::MegaMode;
use normal::NormalMode;
use placement::Placement;
use std::ffi::c_void;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use symmetric::{NativeMemory, NcclMemory, SymmetricMemory};

/// Bytes at the start of every rank's buffer for cross-rank signals of the
/// runtime itself, before the modes' areas: the barrier's `[world]` slots at
/// offset 0 (so the table of peer buffers is also the barrier's table of
/// peer slot arrays), then this rank's barrier counts (entered, passed) at
/// `BARRIER_COUNTER_OFFSET` and its call words at `CALL_WORDS_OFFSET`.
const SIGNAL_BYTES: usize = 64 * 1024;

/// Every kernel of the library, looked up once when the first context on a
/// device loads the module (`loaded_kernels`), each typed by its parameter
/// struct.
pub struct Kernels {
    pub layout: Kernel<LayoutParams>,
    pub barrier: Kernel<BarrierParams>,
    pub dispatch_count: Kernel<DispatchParams>,
    pub dispatch_pull: Kernel<DispatchParams>,
    pub combine_send: Kernel<CombineParams>,
    pub combine_reduce: Kernel<CombineParams>,
    pub ll_dispatch: Kernel<LlParams>,
    pub ll_combine: Kernel<LlParams>,
    /// The same with the network leg (contexts of several nodes).
    pub ll_dispatch_net: Kernel<LlParams>,
    pub ll_combine_net: Kernel<LlParams>,
    pub mega: mega::MegaKernels,
    /// `ep_moe_forward`'s SwiGLU between its two fused calls.
    pub moe_activation: Kernel<MoeParams>,
    pub nccl_peer_bases: Kernel<NcclPeerBasesParams>,
    pub hier_stage: Kernel<HierParams>,
    pub hier_send: Kernel<HierParams>,
    pub hier_forward: Kernel<HierParams>,
    pub hier_node_reduce: Kernel<HierParams>,
    pub hier_wait: Kernel<HierParams>,
    pub hier_rail_barrier: Kernel<HierParams>,
}

impl Kernels {
    fn load(module: &Module) -> Result<Kernels> {
        Ok(Kernels {
            layout: module.function(c"ep_layout_kernel")?,
            barrier: module.function(c"ep_barrier_kernel")?,
            dispatch_count: module.function(c"ep_dispatch_count_kernel")?,
            dispatch_pull: module.function(c"ep_dispatch_pull_kernel")?,
            combine_send: module.function(c"ep_combine_send_kernel")?,
            combine_reduce: module.function(c"ep_combine_reduce_kernel")?,
            ll_dispatch: module.function(c"ep_ll_dispatch_kernel")?,
            ll_combine: module.function(c"ep_ll_combine_kernel")?,
            ll_dispatch_net: module.function(c"ep_ll_dispatch_net_kernel")?,
            ll_combine_net: module.function(c"ep_ll_combine_net_kernel")?,
            mega: mega::MegaKernels::load(module)?,
            moe_activation: module.function(c"ep_moe_activation_kernel")?,
            nccl_peer_bases: module.function(c"ep_nccl_peer_bases_kernel")?,
            hier_stage: module.function(c"ep_hier_stage_kernel")?,
            hier_send: module.function(c"ep_hier_send_kernel")?,
            hier_forward: module.function(c"ep_hier_forward_kernel")?,
            hier_node_reduce: module.function(c"ep_hier_node_reduce_kernel")?,
            hier_wait: module.function(c"ep_hier_wait_kernel")?,
            hier_rail_barrier: module.function(c"ep_hier_rail_barrier_kernel")?,
        })
    }
}

/// A device's kernels, loaded into its primary context `context` (its
/// address).
struct DeviceKernels {
    ordinal: usize,
    context: usize,
    module: Arc<Module>,
    kernels: Arc<Kernels>,
}

/// The kernels of every device this process has made a context on.
static LOADED_KERNELS: Mutex<Vec<DeviceKernels>> = Mutex::new(Vec::new());

/// The kernels of `device`, loaded by the first context made on it and kept
/// for the life of the process (the module holds the device's primary
/// context). Not per context: the driver does not give back the device
/// memory of the loaded functions' code when their module is unloaded (CUDA
/// 13.0, driver 580.159: about 650 KiB for our kernels), so a process that
/// made and destroyed contexts while something else kept the primary
/// context (torch does) lost that much at each one. Loaded again if the
/// primary context is not the one they were loaded into (a device reset).
fn loaded_kernels(device: &Device) -> Result<(Arc<Module>, Arc<Kernels>)> {
    let mut loaded = LOADED_KERNELS
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let (ordinal, context) = (device.ordinal(), device.context() as usize);
    if let Some(k) = loaded
        .iter()
        .find(|k| k.ordinal == ordinal && k.context == context)
    {
        return Ok((k.module.clone(), k.kernels.clone()));
    }
    let module = Arc::new(Module::load(device)?);
    let kernels = Arc::new(Kernels::load(&module)?);
    loaded.retain(|k| k.ordinal != ordinal);
    loaded.push(DeviceKernels {
        ordinal,
        context,
        module: module.clone(),
        kernels: kernels.clone(),
    });
    Ok((module, kernels))
}

pub fn create(
    cfg: &mut Config,
    unique_id: &[u8; 128],
) -> Result<(Box<dyn Backend>, Arc<dyn Monitor>)> {
    // Probe the driver before joining, so a machine without a GPU fails at
    // once with `CudaUnavailable`.
    let device = Device::new(cfg.device as usize)?;
    let (boot, aborted) = Bootstrap::join(unique_id, cfg)?;
    let placement = Placement::exchange(&device, &boot)?;
    let (module, kernels) = loaded_kernels(&device)?;
    log_summary(cfg, &device, &module);
    let one_host = boot.local_ranks().len() == cfg.world();
    let memory: Box<dyn SymmetricMemory> = if one_host && !nccl_requested()? {
        Box::new(NativeMemory::new(
            &device,
            &boot,
            buffer_bytes(cfg),
            &placement.sharing,
        )?)
    } else {
        let comm = own_communicator(&boot, &device)?;
        let gin = gin_signals(cfg, &comm);
        Box::new(NcclMemory::new(
            comm,
            &device,
            &kernels,
            &boot,
            buffer_bytes(cfg),
            gin,
        )?)
    };
    finish(
        cfg,
        device,
        (module, kernels),
        (Box::new(boot), placement),
        memory,
        aborted,
    )
}

/// GIN signals the device communicator needs: the network legs' (the
/// hierarchical mode's, then the low-latency mode's), when the context has
/// several nodes and some rank is outside this rank's NVLink domain (NCCL's
/// LSA team); none otherwise (the legs are emulated over NVLink).
fn gin_signals(cfg: &Config, comm: &CommHandle) -> usize {
    // SAFETY: a live communicator.
    let lsa = unsafe { comm.nccl.team_lsa(comm.comm) };
    let nodes = cfg.nodes();
    if nodes.is_hierarchical() && (lsa.ranks as usize) < cfg.world() {
        hierarchical::gin_signals(nodes) + low_latency::gin_signals(cfg)
    } else {
        0
    }
}

/// Whether `EP_TRANSPORT` asks for NCCL on one host (`nccl`), or not
/// (`native`, the default). Ranks on several hosts always use NCCL.
fn nccl_requested() -> Result<bool> {
    match std::env::var("EP_TRANSPORT").as_deref() {
        Err(_) | Ok("") | Ok("native") => Ok(false),
        Ok("nccl") => Ok(true),
        Ok(other) => Err(Error::invalid(format!(
            "EP_TRANSPORT={other}: expected `native` or `nccl`"
        ))),
    }
}

/// The context's own NCCL communicator over the ranks of `boot`: rank 0
/// makes an `ncclUniqueId`, the bootstrap carries it to every rank, and all
/// call `ncclCommInitRank` (NCCL's own wait).
fn own_communicator(boot: &Bootstrap, device: &Device) -> Result<Arc<CommHandle>> {
    let nccl = nccl::load()?;
    let _context = device.bind()?;
    let mine = if boot.rank() == 0 {
        nccl.unique_id()?.internal.to_vec()
    } else {
        Vec::new()
    };
    let ids = boot.all_gather(&mine)?;
    let internal: [u8; 128] = ids[0]
        .as_slice()
        .try_into()
        .map_err(|_| Error::remote("rank 0 sent a malformed NCCL unique id"))?;
    let comm = nccl.comm_init_rank(boot.world(), UniqueId { internal }, boot.rank())?;
    Ok(Arc::new(CommHandle {
        nccl,
        comm,
        owned: true,
    }))
}

/// The GPU backend on the caller's NCCL communicator
/// (`ep_ctx_create_from_nccl`): `cfg` holds the rank, world and device the
/// communicator reports.
///
/// # Safety
/// `comm` is a live communicator of the loaded NCCL that outlives the
/// context.
pub unsafe fn create_from_nccl(
    cfg: &mut Config,
    comm: nccl::Comm,
) -> Result<(Box<dyn Backend>, Arc<dyn Monitor>)> {
    let nccl = nccl::load()?;
    let device = Device::new(cfg.device as usize)?;
    let aborted = Arc::new(AtomicBool::new(false));
    let comm = Arc::new(CommHandle {
        nccl,
        comm,
        owned: false,
    });
    let group = NcclGroup::new(
        comm.clone(),
        &device,
        (cfg.rank, cfg.world()),
        cfg.timeout,
        aborted.clone(),
    )?;
    // Every LSA team (NVLink domain) is a node unless the config says.
    let lsa = nccl.team_lsa(comm.comm);
    let lsa_ranks: Vec<usize> = if lsa.stride == 1 && lsa.rank >= 0 && lsa.rank <= cfg.rank as i32 {
        let first = cfg.rank - lsa.rank as usize;
        (first..first + lsa.ranks.max(0) as usize).collect()
    } else {
        Vec::new()
    };
    cfg.settle(&group, &lsa_ranks)?;
    let placement = Placement::exchange(&device, &group)?;
    let (module, kernels) = loaded_kernels(&device)?;
    log_summary(cfg, &device, &module);
    let gin = gin_signals(cfg, &comm);
    let memory = NcclMemory::new(comm, &device, &kernels, &group, buffer_bytes(cfg), gin)?;
    finish(
        cfg,
        device,
        (module, kernels),
        (Box::new(group), placement),
        Box::new(memory),
        aborted,
    )
}

/// What both ways of making a GPU context share once the ranks agree and
/// the symmetric buffers exist.
fn finish(
    cfg: &Config,
    device: Device,
    (module, kernels): (Arc<Module>, Arc<Kernels>),
    (group, placement): (Box<dyn HostGroup>, Placement),
    memory: Box<dyn SymmetricMemory>,
    aborted: Arc<AtomicBool>,
) -> Result<(Box<dyn Backend>, Arc<dyn Monitor>)> {
    check_reach(cfg, memory.as_ref())?;
    let monitor = Arc::new(GpuMonitor {
        status: MappedHost::new(&device, 1)?,
        abort_flag: MappedHost::new(&device, 1)?,
        aborted,
        signals: SignalWords::new(&device, memory.own_base(), memory.peer_bases(), cfg.world())?,
        logged: AtomicBool::new(false),
    });
    let rt = Runtime {
        cfg: *cfg,
        device,
        module,
        kernels,
        group,
        memory,
        monitor: monitor.clone(),
        timeout_ns: cfg.timeout.as_nanos() as u64,
        programmatic: programmatic_launch(&placement),
        placement,
    };
    let ll_offset = SIGNAL_BYTES + normal::buffer_bytes(cfg);
    let hier_offset = ll_offset + low_latency::buffer_bytes(cfg);
    let normal = NormalMode::new(&rt, SIGNAL_BYTES, hier_offset)?;
    let ll = LlMode::new(&rt, ll_offset)?;
    let mega = MegaMode::new(&rt)?;
    let all_reachable = rt.memory.host_peer_bases().iter().all(|&b| b != 0);
    // No rank returns (and enqueues a collective) before every rank has
    // made its allocations: on a GPU that ranks share, an allocation could
    // otherwise wait for a peer's kernel that waits for this rank.
    rt.group.barrier()?;
    Ok((
        Box::new(GpuBackend {
            rt,
            normal,
            ll,
            mega,
            all_reachable,
        }),
        monitor,
    ))
}

/// Which ranks this rank's GPU must reach by loads and stores: every rank
/// of its node; with one node, every rank. The others (other nodes) need
/// the GIN network leg.
fn check_reach(cfg: &Config, memory: &dyn SymmetricMemory) -> Result<()> {
    let nodes = cfg.nodes();
    // A base of 0: a rank this GPU does not reach.
    let bases = memory.host_peer_bases();
    let home = nodes.node_of(cfg.rank);
    if let Some(far) = nodes.ranks_of(home).find(|&r| bases[r] == 0) {
        return Err(Error::unsupported(format!(
            "rank {far} is on the node of rank {} (ranks_per_node = {}) but not reachable over NVLink: set ranks_per_node to the NVLink domain's size or less",
            cfg.rank, nodes.ranks_per_node
        )));
    }
    let gin = memory.nccl().is_some_and(|n| n.gin);
    if let Some(far) = bases.iter().position(|&b| b == 0) {
        if !nodes.is_hierarchical() {
            return Err(Error::unsupported(format!(
                "rank {far} is not reachable over NVLink from rank {}: ranks in several NVLink domains need ranks_per_node set to the domain size",
                cfg.rank
            )));
        }
        if !gin {
            return Err(Error::unsupported(format!(
                "rank {far} is on another node and not reachable over NVLink, and NCCL gave no GIN network for the network leg"
            )));
        }
    }
    Ok(())
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

/// Bytes of communication buffer one rank allocates for `cfg`: the
/// runtime's signals, the normal mode's, the low-latency mode's, and with
/// several nodes the hierarchical mode's (network leg buffers included).
pub fn buffer_bytes(cfg: &Config) -> usize {
    SIGNAL_BYTES
        + normal::buffer_bytes(cfg)
        + low_latency::buffer_bytes(cfg)
        + hierarchical::buffer_bytes(cfg)
}

/// The host-mapped words the kernels and any host thread share.
pub struct GpuMonitor {
    /// First error recorded by a kernel of this context.
    status: MappedHost<DeviceStatus>,
    /// Non-zero tells waiting kernels to give up.
    abort_flag: MappedHost<i32>,
    /// Tells host-side waits (bootstrap) to give up.
    aborted: Arc<AtomicBool>,
    /// Where this rank's barrier words are, for the log after a timeout.
    signals: SignalWords,
    /// Whether they were logged already (once per context).
    logged: AtomicBool,
}

/// This rank's barrier slots, barrier and call words, and its table of
/// peer buffers: logged when a wait timed out, to tell a signal that never
/// came from one that came late.
///
/// Read on a stream of their own into pinned memory made with the context:
/// the read waits for no other stream and for no staging buffer, so it
/// cannot hold up a peer sharing the GPU (see `ep_ctx_create`).
struct SignalWords {
    own_base: u64,
    table: u64,
    world: usize,
    stream: OwnedStream,
    /// The copies' destination: the words up to the call words, then the
    /// table. Locked while read, since any thread may ask.
    copy: Mutex<MappedHost<u64>>,
}

impl SignalWords {
    /// Index of the barrier word in the own buffer (the call word follows).
    const WORDS_AT: usize = BARRIER_COUNTER_OFFSET / 8;
    /// Words of the own buffer that [`Self::describe`] reads: the slots up
    /// to the barrier and call words.
    const HEAD_WORDS: usize = Self::WORDS_AT + 2;

    fn new(device: &Device, own_base: u64, table: u64, world: usize) -> Result<SignalWords> {
        Ok(SignalWords {
            own_base,
            table,
            world,
            stream: OwnedStream::new(device)?,
            copy: Mutex::new(MappedHost::new(device, Self::HEAD_WORDS + world)?),
        })
    }

    /// [`Self::describe`], or why the words could not be read.
    fn line(&self) -> String {
        self.describe().unwrap_or_else(|err| err.to_string())
    }

    /// The words as one line (device reads; after a failure, or at DEBUG).
    fn describe(&self) -> Result<String> {
        let copy = self.copy.lock().unwrap_or_else(PoisonError::into_inner);
        let head_bytes = Self::HEAD_WORDS * 8;
        // SAFETY: reads the rank's own buffer (slots, then the words) and
        // its table, both at least this long, into the pinned buffer, which
        // has room for both and is read only after the stream's wait.
        unsafe {
            let _context = self.stream.device().bind()?;
            cuda::check(
                sys::cuMemcpyDtoHAsync_v2(
                    copy.host_ptr().cast(),
                    self.own_base,
                    head_bytes,
                    self.stream.raw(),
                ),
                "cuMemcpyDtoHAsync",
            )?;
            cuda::check(
                sys::cuMemcpyDtoHAsync_v2(
                    copy.host_ptr().add(Self::HEAD_WORDS).cast(),
                    self.table,
                    self.world * 8,
                    self.stream.raw(),
                ),
                "cuMemcpyDtoHAsync",
            )?;
        }
        self.stream.synchronize()?;
        let head: Vec<u64> = (0..Self::HEAD_WORDS).map(|i| copy.read(i)).collect();
        let table: Vec<u64> = (0..self.world)
            .map(|i| copy.read(Self::HEAD_WORDS + i))
            .collect();
        let slots: Vec<String> = head[..self.world]
            .iter()
            .map(|s| format!("{}@{:#x}", *s as u32, s >> 32))
            .collect();
        let words = |w: u64| (w as u32, (w >> 32) as u32);
        let barrier = words(head[Self::WORDS_AT]);
        let calls = words(head[Self::WORDS_AT + 1]);
        let table: Vec<String> = table.iter().map(|b| format!("{b:#x}")).collect();
        Ok(format!(
            "barrier slots (epoch@call) [{}], barriers entered {} passed {}, calls started {} \
             current {:#x}, own buffer {:#x}, peer table [{}]",
            slots.join(", "),
            barrier.0,
            barrier.1,
            calls.0,
            calls.1,
            self.own_base,
            table.join(", ")
        ))
    }
}

impl Monitor for GpuMonitor {
    fn async_error(&self) -> Result<()> {
        let status = self.status.read(0);
        if status.code == abi::STATUS_TIMEOUT && !self.logged.swap(true, Ordering::Relaxed) {
            log::warning!("after a device timeout: {}", self.signals.line());
        } else if log::enabled(log::Level::Debug) {
            // At DEBUG, the words at every look (a device read each time).
            log::debug!("async status {}: {}", status.code, self.signals.line());
        }
        status.to_result()
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
    /// Keeps the kernels' code loaded; `kernels` are its functions (both
    /// shared by the device's contexts, see `loaded_kernels`).
    pub module: Arc<Module>,
    pub kernels: Arc<Kernels>,
    /// The host collectives of the ranks (kept for the context's life).
    pub group: Box<dyn HostGroup>,
    pub memory: Box<dyn SymmetricMemory>,
    pub monitor: Arc<GpuMonitor>,
    /// Longest device-side wait, in nanoseconds of `%globaltimer`.
    pub timeout_ns: u64,
    /// The ranks on this rank's GPU and the share of its SMs this rank gets.
    pub placement: Placement,
    /// Whether kernels that are not cooperative are launched as
    /// programmatic dependents (`programmatic_launch`).
    pub programmatic: bool,
}

/// Whether the kernels of a context with `placement` are launched as
/// programmatic dependents of the kernel ahead on their stream
/// (`LaunchOrder::programmatic`): yes unless `EP_PROGRAMMATIC_LAUNCH` is
/// `0`, or other ranks share this rank's GPU. A programmatic dependent's
/// blocks may take their SMs while the kernel ahead still runs; behind a
/// barrier that waits for a rank on the same GPU, they can hold the SMs
/// that rank's cooperative kernel needs to start, and neither goes on (seen
/// with two ranks on one GPU). Ranks on GPUs of their own need no SM of
/// each other, and there the cooperative kernels are programmatic
/// dependents too (both attributes of `LaunchOrder`): the blocks of
/// one that start early wait only for the kernel ahead on the same stream,
/// which never waits for them, and the rest start as that kernel's blocks
/// leave; so a low-latency pair's second kernel is resident when the first
/// ends instead of being launched then.
fn programmatic_launch(placement: &Placement) -> bool {
    let enabled = std::env::var("EP_PROGRAMMATIC_LAUNCH").map_or(true, |v| v.trim() != "0");
    enabled && placement.sharing.len() == 1
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

    /// Waits until `published()` holds: work queued on `stream` publishes
    /// something the host reads (host-mapped memory, written with a
    /// release), long before the stream has run dry. Then reports any
    /// error a kernel recorded by then. Fails at once on a recorded error
    /// (a wait that timed out or was aborted ends in one), on a failed
    /// stream, and when the stream ran everything without publishing
    /// (`what` names it). The host spins, as a stream synchronisation may;
    /// after `YIELD_AFTER` it yields its core between looks.
    pub fn wait_until_published(
        &self,
        stream: Stream,
        what: &str,
        published: impl Fn() -> bool,
    ) -> Result<()> {
        /// Looks at `published` between two looks at the status and the
        /// stream (each a host memory read or a driver call).
        const LOOKS_PER_CHECK: u32 = 64;
        const YIELD_AFTER: std::time::Duration = std::time::Duration::from_millis(1);
        let start = std::time::Instant::now();
        let mut look = 0u32;
        loop {
            if published() {
                return self.monitor.async_error();
            }
            look = look.wrapping_add(1);
            if !look.is_multiple_of(LOOKS_PER_CHECK) {
                std::hint::spin_loop();
                continue;
            }
            self.monitor.async_error()?;
            // SAFETY: the caller's stream of this device (API rule).
            if unsafe { self.device.stream_done(stream as _)? } {
                // Everything the stream held has run, so what it published
                // is visible: now or never.
                if published() {
                    return self.monitor.async_error();
                }
                self.monitor.async_error()?;
                return Err(Error::internal(format!(
                    "the stream ran dry without publishing {what}"
                )));
            }
            if start.elapsed() > YIELD_AFTER {
                std::thread::yield_now();
            }
        }
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
    /// Whether `stream` is capturing work into a CUDA graph.
    ///
    /// # Safety
    /// `stream` must be a stream of this context's device (or null).
    pub unsafe fn capturing(&self, stream: Stream) -> Result<bool> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller vouches for the stream; the context is current.
        crate::runtime::cuda::check(
            unsafe { sys::cuStreamIsCapturing(stream as _, &mut status) },
            "cuStreamIsCapturing",
        )?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

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
        // SAFETY: as in `launch_ex`.
        unsafe { self.launch_ex(false, kernel, grid, block, shared_bytes, stream, params) }
    }

    /// Launches `kernel` on `stream`, cooperatively when `cooperative` (for
    /// kernels whose blocks wait for each other), and as a programmatic
    /// dependent where the runtime allows it (see `programmatic_launch` and
    /// `Kernel::launch_ex`).
    ///
    /// # Safety
    /// As for `launch`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_ex<P>(
        &self,
        cooperative: bool,
        kernel: &Kernel<P>,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        stream: Stream,
        params: &P,
    ) -> Result<()> {
        let order = LaunchOrder {
            programmatic: self.programmatic,
            cooperative,
        };
        // SAFETY: the runtime keeps the module loaded; the caller vouches
        // for the pointers.
        unsafe {
            kernel.launch_ex(
                &self._guard,
                order,
                grid,
                block,
                shared_bytes,
                stream as _,
                params,
            )
        }
    }

    /// Enqueues a barrier of all ranks on `stream` in the role `role`
    /// (`BARRIER_MIDDLE` or `BARRIER_CLOSING`) for a normal-mode exchange
    /// of kind `exchange` (see `normal::Exchange` and kernels/barrier.cu):
    /// work enqueued after a barrier that runs sees every write any rank
    /// enqueued before it.
    ///
    /// # Safety
    /// `stream` must be a stream of this context's device (or null).
    pub unsafe fn exchange_barrier(&self, role: i32, exchange: i32, stream: Stream) -> Result<()> {
        let (table, rank, world) = (self.memory.peer_bases(), self.cfg.rank, self.cfg.world());
        // SAFETY: passed on from the caller.
        unsafe { self.launch_barrier(table, rank, world, (role, exchange), stream) }
    }

    /// Enqueues a barrier of the `world` ranks whose buffers `table` (a
    /// device array of `world` bases) lists, this rank being entry `rank`
    /// (kernels/barrier.cu, a plain barrier).
    ///
    /// # Safety
    /// `stream` must be a stream of this context's device (or null);
    /// `table` a device array of the context (valid as long as it is).
    pub unsafe fn barrier_over(
        &self,
        table: u64,
        rank: usize,
        world: usize,
        stream: Stream,
    ) -> Result<()> {
        let plain = (BARRIER_PLAIN, EXCHANGE_NONE);
        // SAFETY: passed on from the caller.
        unsafe { self.launch_barrier(table, rank, world, plain, stream) }
    }

    /// The barrier kernel over `table` with `(role, exchange)`.
    ///
    /// # Safety
    /// As [`Bound::barrier_over`].
    unsafe fn launch_barrier(
        &self,
        table: u64,
        rank: usize,
        world: usize,
        (role, exchange): (i32, i32),
        stream: Stream,
    ) -> Result<()> {
        let own = self.memory.own_base();
        let params = BarrierParams {
            peer_signals: table,
            epoch_counter: own + BARRIER_COUNTER_OFFSET as u64,
            open_exchange: own + OPEN_EXCHANGE_OFFSET as u64,
            abort_flag: self.abort_ptr(),
            status: self.status_ptr(),
            timeout_ns: self.timeout_ns,
            rank: rank as i32,
            world: world as i32,
            role,
            exchange,
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
    /// Every rank is reachable over NVLink (the low-latency mode's kernels
    /// need it: they have no network leg yet).
    all_reachable: bool,
}

impl Drop for GpuBackend {
    /// Before the buffers go (the fields drop after this): a dispatch that
    /// returned at its counts may still be moving rows through them, and
    /// its caller need not have waited for its stream, since the call told
    /// it the counts.
    fn drop(&mut self) {
        if let Err(e) = self.normal.wait_for_rows() {
            log::warning!(
                "context destroyed: waiting for the last dispatch's rows failed: {}",
                e.message
            );
        }
    }
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
        let placement = &self.rt.placement;
        if legacy && placement.shared() {
            let ranks: Vec<String> = placement.sharing.iter().map(|r| r.to_string()).collect();
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

    fn check_supported(&self, op: Collective) -> Result<()> {
        match op {
            // Across nodes both modes take the network leg (checked at
            // create: every rank out of reach is on another node, with GIN).
            Collective::Dispatch
            | Collective::Combine
            | Collective::LlDispatch
            | Collective::LlCombine => Ok(()),
            Collective::MegaDispatch
            | Collective::MegaCombine
            | Collective::MoeDispatch
            | Collective::MoeCombine => {
                self.mega.check_supported()?;
                if self.normal.hierarchical() || !self.all_reachable {
                    return Err(Error::unsupported(
                        "the fused kernels run within one NVLink domain (one node): they have no network leg yet",
                    ));
                }
                Ok(())
            }
        }
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

    fn mega_dispatch_gemm(
        &mut self,
        call: Call,
        op: &MegaDispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()> {
        self.mega
            .dispatch_gemm(&self.rt.bind()?, &mut self.normal, call, op, handle, stream)
    }

    fn mega_gemm_combine(
        &mut self,
        call: Call,
        op: &MegaCombineOp,
        handle: &HandleState,
        stream: Stream,
    ) -> Result<()> {
        self.mega
            .gemm_combine(&self.rt.bind()?, &mut self.normal, call, op, handle, stream)
    }

    fn moe_forward(
        &mut self,
        calls: [Call; 2],
        op: &MoeOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()> {
        moe::forward(
            &self.rt.bind()?,
            &mut self.normal,
            &mut self.mega,
            calls,
            op,
            handle,
            stream,
        )
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

    fn ll_keep_timeline(&mut self, keep: bool) -> Result<()> {
        self.ll.keep_timeline(&self.rt, keep)
    }

    fn ll_timeline(&mut self) -> Result<LlTimeline> {
        self.ll.timeline()
    }
}

/// A GPU config for the unit tests of the modes' buffer layouts: `world`
/// ranks in nodes of `rpn` (0: one node), seen from `rank`, 100 normal and
/// `ll_tokens` low-latency tokens per rank, hidden 256, top-4 of 24 experts.
#[cfg(test)]
fn test_config(world: usize, rank: usize, rpn: usize, ll_tokens: usize) -> Config {
    use crate::reference::Dtype;
    use crate::runtime::config::{BackendKind, ConfigRequest};
    Config::new(&ConfigRequest {
        world: world as i32,
        rank: rank as i32,
        device: 0,
        max_tokens_per_rank: 100,
        hidden: 256,
        topk: 4,
        num_experts: 24,
        token_dtype: Dtype::Bf16,
        backend: BackendKind::Gpu,
        num_sms: 8,
        timeout_ms: 1000,
        ll_max_tokens_per_rank: ll_tokens as i32,
        ranks_per_node: rpn as i32,
    })
    .unwrap()
}
