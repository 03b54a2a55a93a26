//! Helpers of the GPU tests (`tests/gpu_*.rs`, run with `--ignored` on a
//! machine with CUDA GPUs): device memory that is poisoned when allocated and
//! freed on drop, GPU configs, and runners that start ranks as threads of
//! this process or as processes.
//!
//! Rank r runs on GPU r mod (GPUs present), so a one-GPU machine runs every
//! multi-rank test with the ranks sharing its GPU. Each rank thread has its
//! own non-blocking stream ([`stream`]): the library refuses the legacy
//! default stream when ranks share a GPU, and this file's copies and
//! fills use the rank's stream, never the legacy one. Ranks sharing a GPU
//! must not free device memory (which waits for the whole GPU) while a
//! peer's collective that waits for this rank is in flight: the tests meet
//! at [`gate`] after their allocations and before their frees.
//!
//! A test that leaves out part of its work for lack of GPUs or memory prints
//! a line starting with "skipped " (scripts/gpu-check.sh counts them).

use super::{last_error, run_ranks, run_ranks_in_processes_killing, show, Ctx, POISON};
use cudarc::driver::sys;
use ep::capi::*;
use std::cell::RefCell;
use std::ptr::null_mut;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub fn cu(res: sys::CUresult, what: &str) {
    assert_eq!(res, sys::CUresult::CUDA_SUCCESS, "{what}");
}

pub fn ok(status: ep_status_t, what: &str) {
    assert_eq!(status, EP_SUCCESS, "{what}: {}", last_error());
}

pub fn device_count() -> usize {
    // SAFETY: plain driver calls.
    unsafe {
        cu(sys::cuInit(0), "cuInit");
        let mut n = 0;
        cu(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount");
        n as usize
    }
}

/// The GPU of rank `rank`: GPUs are dealt out in turn, so ranks share them
/// when there are fewer GPUs than ranks.
pub fn device_of(rank: usize) -> usize {
    rank % device_count()
}

/// Makes device `ordinal`'s primary context current on this thread.
pub fn use_device(ordinal: usize) {
    // SAFETY: plain driver calls.
    unsafe {
        cu(sys::cuInit(0), "cuInit");
        let mut dev = 0;
        cu(sys::cuDeviceGet(&mut dev, ordinal as i32), "cuDeviceGet");
        let mut ctx = null_mut();
        cu(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "retain");
        cu(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    }
}

/// Bytes of memory of device `ordinal` (free, total).
pub fn memory_info(ordinal: usize) -> (usize, usize) {
    use_device(ordinal);
    let (mut free, mut total) = (0, 0);
    // SAFETY: writes two usizes.
    cu(
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo",
    );
    (free, total)
}

/// World sizes of the multi-rank tests: 1, 2 and 4 whatever the GPUs (ranks
/// share them), and 8 when each GPU has at least `gib_per_rank` GiB per
/// rank that would run on it.
pub fn test_worlds(gib_per_rank: usize) -> Vec<usize> {
    let gpus = device_count();
    assert!(gpus >= 1, "these tests need a GPU");
    let (_, total) = memory_info(0);
    let mut worlds = vec![1, 2, 4];
    if (8usize.div_ceil(gpus) * gib_per_rank) << 30 <= total {
        worlds.push(8);
    } else {
        println!(
            "skipped world 8: {gpus} GPU(s) of {} GiB hold fewer than 8 ranks of {gib_per_rank} GiB",
            total >> 30
        );
    }
    if nccl::requested() {
        // NCCL refuses two ranks of one communicator on one GPU.
        worlds.retain(|&w| w <= gpus);
    }
    if let Ok(listed) = std::env::var("EP_TEST_WORLDS") {
        // Some worlds only, e.g. "1,2,4" and "8" in two runs where one run
        // of all would not fit a time limit.
        let listed: Vec<usize> = listed
            .split(',')
            .map(|w| w.trim().parse().expect("EP_TEST_WORLDS: sizes like 1,2,4"))
            .collect();
        for world in worlds.iter().filter(|w| !listed.contains(w)) {
            println!("skipped world {world}: not in EP_TEST_WORLDS");
        }
        worlds.retain(|w| listed.contains(w));
    }
    worlds
}

/// Where the rank threads of one world meet (see [`gate`]). Unlike a
/// `std::sync::Barrier` it breaks when a rank panics, so that the others
/// fail too instead of waiting for ever.
pub struct Gate {
    world: usize,
    /// Ranks arrived in this round, rounds completed, broken.
    state: Mutex<(usize, u64, bool)>,
    all_here: Condvar,
}

impl Gate {
    pub fn new(world: usize) -> Gate {
        Gate {
            world,
            state: Mutex::new((0, 0, false)),
            all_here: Condvar::new(),
        }
    }

    fn wait(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let round = s.1;
        s.0 += 1;
        if s.0 == self.world {
            s.0 = 0;
            s.1 += 1;
            self.all_here.notify_all();
        }
        while s.1 == round && !s.2 {
            s = self.all_here.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        assert!(!s.2, "another rank failed");
    }

    fn break_gate(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.2 = true;
        self.all_here.notify_all();
    }
}

/// Breaks its gate when dropped during a panic.
struct BreakOnPanic(Arc<Gate>);

impl Drop for BreakOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.break_gate();
        }
    }
}

/// What a rank thread of a GPU test has: its stream, and the gate of the
/// ranks it runs with.
struct RankEnv {
    stream: sys::CUstream,
    gate: Option<Arc<Gate>>,
}

impl Drop for RankEnv {
    fn drop(&mut self) {
        // SAFETY: the stream this thread made; its work has finished.
        unsafe { sys::cuStreamDestroy_v2(self.stream) };
    }
}

thread_local! {
    static RANK: RefCell<Option<RankEnv>> = const { RefCell::new(None) };
}

/// Makes this thread a rank on device `ordinal`: current context, a new
/// non-blocking stream, and the `gate` of its world (None: no peers in this
/// process).
fn become_rank(ordinal: usize, gate: Option<Arc<Gate>>) {
    use_device(ordinal);
    keep_pool_memory(ordinal);
    let mut stream = null_mut();
    // SAFETY: creates one stream of the current context.
    cu(
        unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        },
        "cuStreamCreate",
    );
    RANK.with(|r| *r.borrow_mut() = Some(RankEnv { stream, gate }));
}

/// This rank thread's stream (NULL, the legacy default stream, on a thread
/// that is not a rank).
pub fn stream() -> ep_stream_t {
    RANK.with(|r| {
        r.borrow()
            .as_ref()
            .map_or(null_mut(), |e| e.stream as ep_stream_t)
    })
}

/// Waits until every rank thread of this world is here (nothing for a rank
/// process, which has no peers in its process).
pub fn gate() {
    let gate = RANK.with(|r| r.borrow().as_ref().and_then(|e| e.gate.clone()));
    if let Some(gate) = gate {
        gate.wait();
    }
}

/// Waits for all work of this rank's stream (of the current context on a
/// thread that is not a rank).
pub fn sync() {
    let s = stream();
    // SAFETY: plain driver calls on this thread's stream or context.
    if s.is_null() {
        cu(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize");
    } else {
        cu(
            unsafe { sys::cuStreamSynchronize(s as sys::CUstream) },
            "cuStreamSynchronize",
        );
    }
}

/// Device memory of the current context, filled with [`POISON`] when
/// allocated, freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    /// From the device's pool (`cuMemAllocAsync`, on a rank thread), else
    /// from `cuMemAlloc`.
    pooled: bool,
}

impl DevBuf {
    /// `bytes` bytes of poison (at least 4, so a pointer is never NULL).
    pub fn poisoned(bytes: usize) -> DevBuf {
        let alloc = bytes.max(4);
        let mut ptr = 0;
        let s = stream();
        // SAFETY: allocates `alloc` bytes: on a rank thread from the
        // device's pool in the order of the rank's stream (see `Drop`).
        unsafe {
            if s.is_null() {
                cu(sys::cuMemAlloc_v2(&mut ptr, alloc), "cuMemAlloc");
            } else {
                cu(
                    sys::cuMemAllocAsync(&mut ptr, alloc, s as sys::CUstream),
                    "cuMemAllocAsync",
                );
            }
        }
        let buf = DevBuf {
            ptr,
            bytes,
            pooled: !s.is_null(),
        };
        buf.poison();
        buf
    }

    /// Room for `len` values of `T`, poisoned.
    pub fn of<T>(len: usize) -> DevBuf {
        DevBuf::poisoned(len * std::mem::size_of::<T>())
    }

    /// A copy of `host`.
    pub fn from<T: Copy>(host: &[T]) -> DevBuf {
        let buf = DevBuf::poisoned(std::mem::size_of_val(host));
        buf.upload(host);
        buf
    }

    /// Overwrites the start of the buffer with `host` (synchronously).
    pub fn upload<T: Copy>(&self, host: &[T]) {
        let bytes = std::mem::size_of_val(host);
        assert!(
            bytes <= self.bytes,
            "upload of {bytes} B into {} B",
            self.bytes
        );
        if bytes > 0 {
            // An idle stream first (see `download`).
            sync();
            // SAFETY: `bytes` fit the allocation; `host` outlives the sync.
            cu(
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        self.ptr,
                        host.as_ptr() as *const _,
                        bytes,
                        stream() as sys::CUstream,
                    )
                },
                "HtoD",
            );
            sync();
        }
    }

    /// Fills the whole buffer with [`POISON`] (again), after the work
    /// queued on this rank's stream.
    pub fn poison(&self) {
        // SAFETY: fills the allocation.
        cu(
            unsafe {
                sys::cuMemsetD8Async(
                    self.ptr,
                    POISON,
                    self.bytes.max(4),
                    stream() as sys::CUstream,
                )
            },
            "poison",
        );
        sync();
    }

    /// The first `len` values, after the work queued on this rank's stream.
    pub fn download<T: Copy + Default>(&self, len: usize) -> Vec<T> {
        let mut out = vec![T::default(); len];
        let bytes = std::mem::size_of_val(&out[..]);
        assert!(
            bytes <= self.bytes,
            "download of {bytes} B from {} B",
            self.bytes
        );
        if bytes > 0 {
            // The stream's work first: a copy to pageable memory that waits
            // for its stream holds the driver's staging buffers, which the
            // copies of ranks sharing the GPU need too, and this stream's
            // kernels may be waiting for such a rank.
            sync();
            // SAFETY: `bytes` fit both sides; `out` outlives the sync.
            cu(
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(
                        out.as_mut_ptr() as *mut _,
                        self.ptr,
                        bytes,
                        stream() as sys::CUstream,
                    )
                },
                "DtoH",
            );
        }
        sync();
        out
    }

    pub fn as_mut<T>(&self) -> *mut T {
        self.ptr as *mut T
    }

    pub fn as_const<T>(&self) -> *const T {
        self.ptr as *const T
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated as `pooled` says; the tests synchronize before
        // buffers go out of scope. A pool allocation is freed in stream
        // order, without the wait for the whole device that cuMemFree makes
        // (which, on a GPU that ranks share, could wait for a peer's kernel
        // that waits for this rank).
        unsafe {
            if self.pooled {
                sys::cuMemFreeAsync(self.ptr, stream() as sys::CUstream);
            } else {
                sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

/// Lets the device's default pool keep the memory of freed buffers (the
/// rank threads' `DevBuf`s) until [`trim_pool`]: a pool that gives memory
/// back at every synchronization maps it again at the next allocation, and
/// mapping may wait for the whole device, which on a GPU that ranks share
/// could wait for a peer's kernel that waits for this rank.
fn keep_pool_memory(ordinal: usize) {
    let mut keep = u64::MAX;
    // SAFETY: the attribute is a u64.
    cu(
        unsafe {
            sys::cuMemPoolSetAttribute(
                default_pool(ordinal),
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            )
        },
        "cuMemPoolSetAttribute",
    );
}

/// The default memory pool of device `ordinal` (what `cuMemAllocAsync`
/// takes from).
fn default_pool(ordinal: usize) -> sys::CUmemoryPool {
    let mut pool = null_mut();
    // SAFETY: writes one pool handle.
    cu(
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ordinal as i32) },
        "cuDeviceGetDefaultMemPool",
    );
    pool
}

/// Returns the memory that the device's default pool keeps for later
/// allocations (the rank threads' `DevBuf`s) to the device.
pub fn trim_pool(ordinal: usize) {
    use_device(ordinal);
    let pool = default_pool(ordinal);
    // SAFETY: plain driver calls on the current context and its pool.
    unsafe {
        cu(sys::cuCtxSynchronize(), "cuCtxSynchronize");
        cu(sys::cuMemPoolTrimTo(pool, 0), "cuMemPoolTrimTo");
    }
}

/// A GPU-backend config of the given shape (normal mode up to
/// `max_tokens`, low-latency mode up to `ll_max` tokens).
pub fn gpu_config(
    hidden: i32,
    topk: i32,
    num_experts: i32,
    max_tokens: i32,
    ll_max: i32,
    timeout_ms: u32,
) -> ep_config_t {
    let mut cfg = super::host_config(hidden, topk, num_experts, max_tokens, ll_max);
    cfg.backend = EP_BACKEND_GPU;
    cfg.timeout_ms = timeout_ms;
    cfg
}

/// Makes rank `rank`'s context of a `world`-rank group on GPU `ordinal`, as
/// a rank thread with the world's `gate`, and checks that creating it left
/// the thread's current CUDA context alone. With `EP_TEST_NCCL=1` in the
/// environment the context is made by `ep_ctx_create_from_nccl` on an NCCL
/// communicator of the group instead (see [`nccl`]), so the same tests run
/// every mode on NCCL windows.
fn join_on_gpu(
    world: usize,
    cfg: &ep_config_t,
    rank: usize,
    ordinal: usize,
    gate: Option<Arc<Gate>>,
    id: ep_unique_id_t,
) -> Ctx {
    become_rank(ordinal, gate);
    let mut before = null_mut();
    let mut after = null_mut();
    // SAFETY: plain driver calls.
    cu(unsafe { sys::cuCtxGetCurrent(&mut before) }, "current");
    let ctx = if nccl::requested() {
        nccl::context(world, cfg, rank, &id)
    } else {
        Ctx::create_on(world as i32, id, rank as i32, ordinal as i32, cfg)
    };
    cu(unsafe { sys::cuCtxGetCurrent(&mut after) }, "current");
    assert_eq!(before, after, "ep_ctx_create changed the current context");
    ctx
}

/// Runs `body(rank, ctx)` on `world` threads, rank r on GPU
/// [`device_of`]`(r)` with its own context and stream, and returns the
/// results in rank order.
pub fn run_gpu_world<T: Send>(
    world: usize,
    cfg: &ep_config_t,
    body: impl Fn(usize, &Ctx) -> T + Sync,
) -> Vec<T> {
    run_gpu_world_on(world, cfg, device_of, body)
}

/// [`run_gpu_world`] with rank r on GPU `ordinal(r)`.
pub fn run_gpu_world_on<T: Send>(
    world: usize,
    cfg: &ep_config_t,
    ordinal: impl Fn(usize) -> usize + Sync,
    body: impl Fn(usize, &Ctx) -> T + Sync,
) -> Vec<T> {
    let gate = Arc::new(Gate::new(world));
    run_ranks(
        world,
        |rank, id| join_on_gpu(world, cfg, rank, ordinal(rank), Some(gate.clone()), id),
        |rank, ctx| {
            let _break = BreakOnPanic(gate.clone());
            let out = body(rank, ctx);
            // A context is destroyed only when no work of it runs (API
            // rule), and a call may return with work in flight (a dispatch
            // that waited for its counts only).
            settle();
            out
        },
    )
}

/// Waits for this rank's stream, whatever became of its work (a failed
/// stream is the test's to report; its context goes away next).
fn settle() {
    let s = stream();
    if !s.is_null() {
        // SAFETY: a plain driver call on this thread's stream.
        let _ = unsafe { sys::cuStreamSynchronize(s as sys::CUstream) };
    }
}

/// NCCL communicators for the GPU tests: `EP_TEST_NCCL=1` makes every GPU
/// test context a context on an NCCL communicator (ranks as threads share
/// one `ncclUniqueId` per group). NCCL is loaded from `EP_NCCL_LIBRARY`,
/// else `libnccl.so.2`, with `RTLD_GLOBAL`, so that ep finds the same copy.
pub mod nccl {
    use super::super::{last_error, Ctx};
    use ep::capi::*;
    use std::collections::HashMap;
    use std::ffi::{c_char, c_int, c_void, CString};
    use std::sync::{Mutex, OnceLock};

    pub type Comm = *mut c_void;

    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct UniqueId(pub [u8; 128]);

    pub struct Lib {
        pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
        pub comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int,
        pub comm_destroy: unsafe extern "C" fn(Comm) -> c_int,
        pub comm_count: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
        pub get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
        pub error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    }

    /// Symbol `name` of `lib` as a function pointer of type `T`.
    ///
    /// # Safety
    /// `T` must be the symbol's function type.
    unsafe fn symbol<T: Copy>(lib: *mut c_void, name: &str) -> T {
        let c = CString::new(name).unwrap();
        let p = libc::dlsym(lib, c.as_ptr());
        assert!(!p.is_null(), "the NCCL library lacks {name}");
        std::mem::transmute_copy::<*mut c_void, T>(&p)
    }

    /// True when the tests should make their contexts on NCCL.
    pub fn requested() -> bool {
        std::env::var("EP_TEST_NCCL").is_ok_and(|v| v == "1")
    }

    /// The NCCL library (loaded once per process).
    pub fn lib() -> &'static Lib {
        static LIB: OnceLock<Lib> = OnceLock::new();
        LIB.get_or_init(|| {
            let name = std::env::var("EP_NCCL_LIBRARY").unwrap_or_else(|_| "libnccl.so.2".into());
            let c_name = CString::new(name.clone()).unwrap();
            // SAFETY: dlopen/dlsym with NUL-terminated names; the symbols
            // get their nccl.h types.
            unsafe {
                let lib = libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
                assert!(!lib.is_null(), "cannot load NCCL from {name}");
                Lib {
                    get_unique_id: symbol(lib, "ncclGetUniqueId"),
                    comm_init_rank: symbol(lib, "ncclCommInitRank"),
                    comm_destroy: symbol(lib, "ncclCommDestroy"),
                    comm_count: symbol(lib, "ncclCommCount"),
                    get_version: symbol(lib, "ncclGetVersion"),
                    error_string: symbol(lib, "ncclGetErrorString"),
                }
            }
        })
    }

    fn check(result: c_int, what: &str) {
        if result != 0 {
            // SAFETY: a static string.
            let text = unsafe { std::ffi::CStr::from_ptr((lib().error_string)(result)) };
            panic!("{what}: NCCL error {result} ({})", text.to_string_lossy());
        }
    }

    /// A new `ncclUniqueId`.
    pub fn new_id() -> UniqueId {
        let mut id = UniqueId([0; 128]);
        // SAFETY: writes one id.
        check(unsafe { (lib().get_unique_id)(&mut id) }, "ncclGetUniqueId");
        id
    }

    /// The `ncclUniqueId` of the group whose ep id is `group` (made by the
    /// first rank that asks).
    fn group_id(group: &[u8; 128]) -> UniqueId {
        static IDS: Mutex<Vec<([u8; 128], UniqueId)>> = Mutex::new(Vec::new());
        let mut ids = IDS.lock().unwrap();
        if let Some((_, id)) = ids.iter().find(|(g, _)| g == group) {
            return *id;
        }
        let id = new_id();
        ids.push((*group, id));
        id
    }

    /// A communicator of rank `rank` of `world` on the current device.
    pub fn communicator(world: usize, rank: usize, id: UniqueId) -> Comm {
        let mut comm = std::ptr::null_mut();
        // SAFETY: writes one communicator.
        check(
            unsafe { (lib().comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) },
            "ncclCommInitRank",
        );
        comm
    }

    /// The communicators of live test contexts, destroyed with them.
    fn comms() -> &'static Mutex<HashMap<usize, usize>> {
        static COMMS: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
        COMMS.get_or_init(|| Mutex::new(HashMap::new()))
    }

    /// Rank `rank`'s context on `comm` (`ep_ctx_create_from_nccl`: the
    /// communicator stays the caller's).
    pub fn context_on(comm: Comm, cfg: &ep_config_t, rank: usize) -> Ctx {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a live communicator, a valid config and out-parameter.
        let status = unsafe { ep_ctx_create_from_nccl(comm.cast(), cfg, &mut ctx) };
        assert_eq!(status, EP_SUCCESS, "rank {rank}: {}", last_error());
        Ctx(ctx)
    }

    /// Rank `rank`'s context on a fresh communicator of its group, on the
    /// current device; the communicator is destroyed after the context.
    pub fn context(world: usize, cfg: &ep_config_t, rank: usize, group: &ep_unique_id_t) -> Ctx {
        let comm = communicator(world, rank, group_id(&group.internal));
        let ctx = context_on(comm, cfg, rank);
        comms()
            .lock()
            .unwrap()
            .insert(ctx.0 as usize, comm as usize);
        ctx
    }

    /// Called after `ep_ctx_destroy(ctx)`: destroys the context's
    /// communicator if this module made it.
    pub fn release(ctx: *mut ep_ctx_t) {
        let Some(comm) = comms().lock().unwrap().remove(&(ctx as usize)) else {
            return;
        };
        // SAFETY: our own communicator, no longer used by its context.
        unsafe { (lib().comm_destroy)(comm as Comm) };
    }
}

/// How the ranks of a GPU test run: threads of this process, or processes
/// running the test named `test` (see [`run_ranks_in_processes`]).
#[derive(Clone, Copy, Debug)]
pub enum Ranks {
    Threads,
    Processes { test: &'static str },
}

/// Runs `body(rank, ctx)` on `world` ranks, rank r on GPU [`device_of`]`(r)`
/// with its own context, as `ranks` says; `call` names this call among the
/// test's calls. Ranks as processes need a GPU each (processes cannot share
/// one): with fewer GPUs the call prints why and runs nothing.
pub fn run_gpu_ranks(
    ranks: Ranks,
    call: &str,
    world: usize,
    cfg: &ep_config_t,
    body: impl Fn(usize, &Ctx) + Sync,
) {
    match ranks {
        Ranks::Threads => {
            run_gpu_world(world, cfg, body);
        }
        Ranks::Processes { test } => run_gpu_processes(test, call, world, cfg, &[], body),
    }
}

/// Runs `body(rank, ctx)` on `world` rank processes running the test named
/// `test` (see [`super::run_ranks_in_processes_killing`]), rank r on GPU r
/// with its own context; the ranks in `killed` must end by SIGKILL, the
/// others pass. `call` names this call among the test's calls. Processes
/// cannot share a GPU: with fewer GPUs than ranks the call prints why and
/// runs nothing.
pub fn run_gpu_processes(
    test: &str,
    call: &str,
    world: usize,
    cfg: &ep_config_t,
    killed: &[usize],
    body: impl Fn(usize, &Ctx),
) {
    let gpus = device_count();
    if world > gpus {
        println!(
            "skipped {call}: {world} ranks as processes need {world} GPUs, this machine has {gpus}"
        );
        return;
    }
    run_ranks_in_processes_killing(
        test,
        call,
        world,
        killed,
        |rank, id| join_on_gpu(world, cfg, rank, rank, None, id),
        body,
    )
}

/// The context's async error status.
pub fn async_status(ctx: &Ctx) -> ep_status_t {
    let mut status = -1;
    // SAFETY: live context, valid out-parameter.
    ok(
        unsafe { ep_ctx_get_async_error(ctx.0, &mut status) },
        "async",
    );
    status
}

/// A CUDA graph of the work `record(stream)` enqueues on a new stream of the
/// current context, captured once; freed on drop.
pub struct Graph {
    stream: sys::CUstream,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

impl Graph {
    /// Captures on a new non-blocking stream (see the file comment).
    pub fn capture(record: impl FnOnce(ep_stream_t)) -> Graph {
        let mut g = Graph {
            stream: null_mut(),
            graph: null_mut(),
            exec: null_mut(),
        };
        // SAFETY: plain driver calls on this thread's current context.
        unsafe {
            cu(
                sys::cuStreamCreate(
                    &mut g.stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
                "cuStreamCreate",
            );
            cu(
                sys::cuStreamBeginCapture_v2(
                    g.stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                "begin capture",
            );
        }
        record(g.stream as ep_stream_t);
        // SAFETY: ends the capture begun above.
        unsafe {
            cu(
                sys::cuStreamEndCapture(g.stream, &mut g.graph),
                "end capture",
            );
            cu(
                sys::cuGraphInstantiateWithFlags(&mut g.exec, g.graph, 0),
                "instantiate",
            );
        }
        g
    }

    /// Runs the graph once and waits for it.
    pub fn replay(&self) {
        // SAFETY: the instantiated graph on its stream; the caller keeps
        // the captured buffers alive.
        unsafe {
            cu(sys::cuGraphLaunch(self.exec, self.stream), "cuGraphLaunch");
            cu(sys::cuStreamSynchronize(self.stream), "sync");
        }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: created in capture; nothing runs any more after replay.
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

/// Device memory of the current CUDA context, for the contract walks and
/// calls of [`super::calls`] (`Mem`): a GPU test runs the same walks as
/// tests/contract.rs with `DeviceMem` in place of `HostMem`.
pub struct DeviceMem {
    /// See `Mem::combine_tolerance`.
    pub combine_tolerance: f32,
}

impl super::calls::Buf for DevBuf {
    fn ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
    fn len(&self) -> usize {
        self.bytes
    }
    fn write(&self, data: &[u8]) {
        self.upload(data);
    }
    fn read(&self) -> Vec<u8> {
        self.download(self.bytes)
    }
    fn poison(&self) {
        DevBuf::poison(self);
    }
}

impl super::calls::Mem for DeviceMem {
    fn alloc(&self, bytes: usize) -> Box<dyn super::calls::Buf> {
        Box::new(DevBuf::poisoned(bytes.max(16)))
    }
    fn write_at(&self, ptr: *mut u8, data: &[u8]) {
        // SAFETY: `ptr` is device memory the library gave out, with room;
        // `data` outlives the sync.
        cu(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    ptr as u64,
                    data.as_ptr() as *const _,
                    data.len(),
                    stream() as sys::CUstream,
                )
            },
            "HtoD",
        );
        sync();
    }
    fn combine_tolerance(&self) -> f32 {
        self.combine_tolerance
    }
    fn fused_status(&self) -> ep_status_t {
        // The fused kernels run on Hopper (compute capability 9.x) only.
        // SAFETY: plain driver calls on the current context.
        let major = unsafe {
            let (mut dev, mut major) = (0, 0);
            cu(sys::cuCtxGetDevice(&mut dev), "cuCtxGetDevice");
            cu(
                sys::cuDeviceGetAttribute(
                    &mut major,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    dev,
                ),
                "compute capability",
            );
            major
        };
        if major == 9 {
            EP_SUCCESS
        } else {
            EP_ERR_UNSUPPORTED
        }
    }
    fn stream(&self) -> ep_stream_t {
        stream()
    }
}

/// The iteration of [`until_the_timeout`] in which the last rank kills its
/// process.
pub const KILL_AT: usize = 5;

/// The world of a killed-rank test: one rank process per GPU, 2 to 8 of
/// them; None, after printing why, on a machine with fewer than 2 GPUs.
pub fn one_process_per_gpu(test: &str) -> Option<usize> {
    let gpus = device_count();
    if gpus < 2 {
        println!("skipped {test}: ranks as processes need 2 GPUs, this machine has {gpus}");
        return None;
    }
    Some(gpus.min(8))
}

/// Runs `body(rank, ctx)` on `world` rank processes of the test named
/// `test`, rank r on GPU r, where the last rank kills its process (in
/// [`until_the_timeout`]): it must end by SIGKILL, every other rank pass.
pub fn run_with_a_killed_rank(
    test: &str,
    world: usize,
    cfg: &ep_config_t,
    body: impl Fn(usize, &Ctx),
) {
    let call = format!("{world} ranks, rank {} killed", world - 1);
    run_gpu_processes(test, &call, world, cfg, &[world - 1], body);
}

/// Rank `rank` of a `world`-rank killed-rank test: iterations of
/// `dispatch()` then `combine()` (each enqueues one correct call on this
/// rank's stream and returns its status), a sync, and the context's async
/// status. In iteration [`KILL_AT`] the last rank kills its process once its
/// dispatch is enqueued (work in flight, a combine never made). Every other
/// rank must succeed until then, and then see `EP_ERR_TIMEOUT` (returned by
/// a call, or the async status after the sync) within `timeout` plus 10 s
/// of the start of iteration `KILL_AT`; it prints how long it took. The
/// caller's context must then be destroyed without error (`Ctx`'s drop).
pub fn until_the_timeout(
    ctx: &Ctx,
    rank: usize,
    world: usize,
    timeout: Duration,
    dispatch: impl Fn() -> ep_status_t,
    combine: impl Fn() -> ep_status_t,
) {
    let killer = rank == world - 1;
    let mut kill_began = Instant::now();
    for i in 0..=KILL_AT + 1 {
        if i == KILL_AT {
            kill_began = Instant::now();
        }
        let mut status = dispatch();
        if killer && i == KILL_AT {
            assert_eq!(
                status,
                EP_SUCCESS,
                "the dispatch before the kill: {}",
                last_error()
            );
            kill_this_process();
        }
        if status == EP_SUCCESS {
            status = combine();
        }
        if status == EP_SUCCESS {
            sync();
            status = async_status(ctx);
        }
        if status == EP_SUCCESS {
            continue;
        }
        // Every call of the context has ended (the kernels gave up).
        sync();
        let took = kill_began.elapsed();
        let message = last_error();
        let what = format!("rank {rank}, iteration {i}: status {status}: {message}");
        assert!(i >= KILL_AT, "{what}");
        assert_eq!(status, EP_ERR_TIMEOUT, "{what}");
        show(&format!(
            "EP_ERR_TIMEOUT in iteration {i}, {:.2} s after iteration {KILL_AT} began \
             (timeout {:.1} s): {}",
            took.as_secs_f64(),
            timeout.as_secs_f64(),
            message.lines().next().unwrap_or("")
        ));
        assert!(
            took <= timeout + Duration::from_secs(10),
            "{what}: the timeout took {took:?}"
        );
        return;
    }
    panic!(
        "rank {rank}: no timeout after rank {} was killed",
        world - 1
    );
}

/// Ends this process by SIGKILL, as a crash would: no unwinding, no
/// destructors, work left on the GPU.
pub fn kill_this_process() -> ! {
    // SAFETY: sends a signal to this process.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    // The signal ends every thread before the call returns to this one.
    std::thread::sleep(Duration::from_secs(10));
    panic!("still alive 10 s after SIGKILL");
}

/// Whether iteration `i` of a repeatability test is also checked against the
/// reference: the first and every 100th.
pub fn checked_iteration(i: usize) -> bool {
    i.is_multiple_of(100)
}

/// The seed of rank `rank`'s input in iteration `i` of a repeatability test.
pub fn repeat_seed(i: usize, rank: usize) -> u64 {
    ((i as u64) << 8) | rank as u64
}

/// Rank `rank`'s token count in iteration `i` of a repeatability test:
/// 0, 1, `max`, or uniform in `[0, max]`.
pub fn repeat_count(i: usize, rank: usize, max: usize) -> usize {
    let mut rng = super::Rng::new(repeat_seed(i, rank) ^ 0x636f_756e_7400_0000);
    match rng.below(6) {
        0 => 0,
        1 => 1,
        2 => max,
        _ => rng.below(max + 1),
    }
}

/// A repeatability test of `mode`: two runs of `run(world, iterations)`
/// (fresh contexts, ranks as threads, one per GPU and at most 8;
/// `EP_REPEAT_ITERS` iterations, else 200), each returning every rank's
/// running output hash after each iteration, by rank. Prints the final
/// hashes and the rate, and fails unless both runs hashed the same: names
/// the first iteration that differs.
pub fn assert_repeatable(mode: &str, run: impl Fn(usize, usize) -> Vec<Vec<u64>>) {
    let world = device_count().min(8);
    let iterations = std::env::var("EP_REPEAT_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let what = format!("{mode}, world {world}");
    let mut runs = Vec::new();
    for pass in 1..=2 {
        let start = Instant::now();
        let hashes = run(world, iterations);
        let secs = start.elapsed().as_secs_f64();
        for (rank, h) in hashes.iter().enumerate() {
            assert_eq!(h.len(), iterations, "{what}: rank {rank}'s hashes");
        }
        let last: Vec<String> = hashes
            .iter()
            .map(|h| format!("{:016x}", h.last().copied().unwrap_or(0)))
            .collect();
        println!(
            "{what}, run {pass}: {iterations} iterations in {secs:.1} s ({:.1} iterations/s), \
             final hash of each rank [{}]",
            iterations as f64 / secs,
            last.join(", ")
        );
        runs.push(hashes);
    }
    for (rank, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
        if let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) {
            panic!(
                "{what}: rank {rank}'s outputs differ between the two runs, first in iteration {i}"
            );
        }
    }
}
