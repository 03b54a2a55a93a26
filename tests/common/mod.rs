//! Helpers shared by the C API tests: a deterministic RNG, BF16 conversion,
//! host-backend configs, a runner that starts ranks as threads, and poisoned
//! output buffers; every operation as a ready call ([`calls`]) and the
//! contract walks over them ([`walk`]).

#![allow(dead_code)]

pub mod calls;
pub mod gpu;
pub mod mega;
pub mod moe;
pub mod normal;
pub mod tools;
pub mod walk;

use ep::capi::*;
use ep::reference::Dtype;
use half::bf16;
use std::ffi::CStr;
use std::ptr::null_mut;

/// Byte every output buffer is filled with before a call.
pub const POISON: u8 = 0xAB;

/// Tiny deterministic PRNG (splitmix64).
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)`; `n` must be positive.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u32 << 24) as f32
    }

    pub fn chance(&mut self, p: f32) -> bool {
        self.unit() < p
    }

    pub fn bytes(&mut self, out: &mut [u8]) {
        for b in out {
            *b = self.next_u64() as u8;
        }
    }
}

/// Routing for `num_tokens` tokens: distinct experts per token, each slot
/// dropped (-1) with probability `drop`; `skewed` sends most tokens' first
/// slot to `hot`.
pub fn routing(
    rng: &mut Rng,
    num_experts: usize,
    topk: usize,
    num_tokens: usize,
    drop: f32,
    skewed: Option<usize>,
) -> Vec<i32> {
    let mut out = Vec::with_capacity(num_tokens * topk);
    for _ in 0..num_tokens {
        let mut pool: Vec<i32> = (0..num_experts as i32).collect();
        for k in 0..topk {
            let pick = match skewed {
                Some(hot) if k == 0 && rng.chance(0.85) => {
                    pool.iter().position(|&e| e == hot as i32).unwrap()
                }
                _ => k + rng.below(num_experts - k),
            };
            pool.swap(k, pick);
        }
        for &id in &pool[..topk] {
            out.push(if rng.chance(drop) { -1 } else { id });
        }
    }
    out
}

/// Positive routing weights in `[0.05, 1.05)`.
pub fn weights(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| 0.05 + rng.unit()).collect()
}

/// BF16 values in `[-2, 2)`.
pub fn random_bf16(rng: &mut Rng, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(4.0 * rng.unit() - 2.0))
        .collect()
}

pub fn bf16_to_bytes(values: &[bf16]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn bytes_to_bf16(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks_exact(2)
        .map(|b| bf16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// A buffer of `n` elements of `T` whose bytes are all [`POISON`].
pub fn poisoned<T: Copy>(n: usize) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    // SAFETY: the element types used here (integers, floats, bf16) accept any
    // bit pattern; the bytes are written before the length is set.
    unsafe {
        std::ptr::write_bytes(
            v.as_mut_ptr() as *mut u8,
            POISON,
            n * std::mem::size_of::<T>(),
        );
        v.set_len(n);
    }
    v
}

/// The bytes of `values` (integers, floats, bf16: plain data).
pub fn bytes_of<T: Copy>(values: &[T]) -> &[u8] {
    // SAFETY: reads the plain bytes of `values`.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values))
    }
}

/// True when every byte of `values` is still [`POISON`].
pub fn is_poisoned<T: Copy>(values: &[T]) -> bool {
    bytes_of(values).iter().all(|&b| b == POISON)
}

/// A running 64-bit FNV-1a hash of bytes (`Fnv::default()` to start).
#[derive(Clone, Copy, Debug)]
pub struct Fnv(pub u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub fn bytes(&mut self, data: &[u8]) {
        for &b in data {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// Hashes the bytes of `values`.
    pub fn values<T: Copy>(&mut self, values: &[T]) {
        self.bytes(bytes_of(values));
    }
}

/// The token dtype of an `fp8` flag.
pub fn dtype_of(fp8: bool) -> Dtype {
    if fp8 {
        Dtype::Fp8E4m3
    } else {
        Dtype::Bf16
    }
}

/// The `EP_DTYPE_*` value of `dtype`.
pub fn dtype_code(dtype: Dtype) -> i32 {
    match dtype {
        Dtype::Bf16 => EP_DTYPE_BF16,
        Dtype::Fp8E4m3 => EP_DTYPE_FP8_E4M3,
    }
}

/// This process's open file descriptors and threads.
pub fn fds_and_threads() -> (usize, usize) {
    let count = |dir| std::fs::read_dir(dir).unwrap().count();
    (count("/proc/self/fd"), count("/proc/self/task"))
}

/// Bits of an f32 slice, for bit-exact comparisons that treat NaN sanely.
pub fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The calling thread's last error message.
pub fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(ep_get_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// A config with the defaults, then the host backend and the given shape.
pub fn host_config(
    hidden: i32,
    topk: i32,
    num_experts: i32,
    max_tokens: i32,
    ll_max: i32,
) -> ep_config_t {
    let mut cfg = std::mem::MaybeUninit::<ep_config_t>::uninit();
    // SAFETY: `ep_config_init` fills the whole struct.
    let mut cfg = unsafe {
        assert_eq!(ep_config_init(cfg.as_mut_ptr()), EP_SUCCESS);
        cfg.assume_init()
    };
    cfg.backend = EP_BACKEND_HOST;
    cfg.hidden = hidden;
    cfg.topk = topk;
    cfg.num_experts = num_experts;
    cfg.max_tokens_per_rank = max_tokens;
    cfg.ll_max_tokens_per_rank = ll_max;
    cfg.timeout_ms = 20_000;
    cfg
}

pub fn unique_id() -> ep_unique_id_t {
    let mut id = ep_unique_id_t {
        internal: [0; EP_UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is a valid out-parameter.
    let status = unsafe { ep_get_unique_id(&mut id) };
    assert_eq!(status, EP_SUCCESS, "ep_get_unique_id: {}", last_error());
    id
}

/// One rank's context, destroyed on drop (which must succeed).
pub struct Ctx(pub *mut ep_ctx_t);

// SAFETY: a context is used by one thread at a time (the one that owns it).
unsafe impl Send for Ctx {}

impl Ctx {
    pub fn create(world: i32, id: ep_unique_id_t, rank: i32, cfg: &ep_config_t) -> Ctx {
        Ctx::create_on(world, id, rank, 0, cfg)
    }

    /// A context of rank `rank` on CUDA device `device`.
    pub fn create_on(
        world: i32,
        id: ep_unique_id_t,
        rank: i32,
        device: i32,
        cfg: &ep_config_t,
    ) -> Ctx {
        let mut ctx = null_mut();
        // SAFETY: valid out-parameter and config.
        let status = unsafe { ep_ctx_create(&mut ctx, world, id, rank, device, cfg) };
        assert_eq!(status, EP_SUCCESS, "rank {rank}: {}", last_error());
        assert!(!ctx.is_null());
        Ctx(ctx)
    }

    /// A world-1 host context.
    pub fn single(cfg: &ep_config_t) -> Ctx {
        Ctx::create(1, unique_id(), 0, cfg)
    }

    pub fn handle(&self) -> Handle {
        let mut h = null_mut();
        // SAFETY: live context, valid out-parameter.
        let status = unsafe { ep_handle_create(self.0, &mut h) };
        assert_eq!(status, EP_SUCCESS, "{}", last_error());
        Handle(h)
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: the context is live and no work is running.
        let status = unsafe { ep_ctx_destroy(self.0) };
        // A GPU test context on an NCCL communicator of the test's own.
        gpu::nccl::release(self.0);
        if !std::thread::panicking() {
            assert_eq!(status, EP_SUCCESS, "ep_ctx_destroy: {}", last_error());
        }
    }
}

/// A routing handle, destroyed on drop (declare it after its context).
pub struct Handle(pub *mut ep_handle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle is live.
        unsafe { ep_handle_destroy(self.0) };
    }
}

/// Runs `body(rank, ctx)` for every rank of a `world`-rank host group, each
/// rank on its own thread with its own context, and returns the results in
/// rank order. A panic on any rank fails the caller.
pub fn run_world<T: Send>(
    world: usize,
    cfg: &ep_config_t,
    body: impl Fn(usize, &Ctx) -> T + Sync,
) -> Vec<T> {
    run_ranks(
        world,
        |rank, id| Ctx::create(world as i32, id, rank as i32, cfg),
        body,
    )
}

/// Starts `world` threads; thread `rank` makes its context with
/// `join(rank, id)` (one unique id for all) and runs `body` on it. Returns
/// the results in rank order; a panic on any rank fails the caller.
pub fn run_ranks<T: Send>(
    world: usize,
    join: impl Fn(usize, ep_unique_id_t) -> Ctx + Sync,
    body: impl Fn(usize, &Ctx) -> T + Sync,
) -> Vec<T> {
    let id = unique_id();
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..world)
            .map(|rank| {
                let (join, body) = (&join, &body);
                s.spawn(move || body(rank, &join(rank, id)))
            })
            .collect();
        threads
            .into_iter()
            .enumerate()
            .map(|(rank, t)| t.join().unwrap_or_else(|_| panic!("rank {rank} panicked")))
            .collect()
    })
}

/// Environment of a rank process started by [`run_ranks_in_processes`]:
/// which call of the test it belongs to, its rank, and the unique id (hex).
const CALL_ENV: &str = "EP_TEST_RANK_CALL";
const RANK_ENV: &str = "EP_TEST_RANK";
const ID_ENV: &str = "EP_TEST_UNIQUE_ID";

/// Marks a line that a rank process prints for the starting process to
/// print too (see [`show`]); the test harness may have begun the line.
const SHOWN: &str = "[shown by the starting process] ";

/// Prints `line` in a rank process of [`run_ranks_in_processes`] so that the
/// starting process prints it too (after the rank), in the test's output.
pub fn show(line: &str) {
    println!("{SHOWN}{line}");
}

/// Runs `body(rank, ctx)` for every rank of a `world`-rank group, each rank
/// in its own process, its context made with `join(rank, id)`.
///
/// The processes are this test binary started again, one per rank, running
/// only the test named `test`, which must reach this call again with the
/// same `call` (a name for this call among the test's calls of this
/// function). There, the call runs the rank's body and returns, and the
/// test's other calls return at once. The starting process holds the unique
/// id's rendezvous, waits for every rank, prints the lines they [`show`],
/// and fails unless each ran the test and passed.
pub fn run_ranks_in_processes(
    test: &str,
    call: &str,
    world: usize,
    join: impl Fn(usize, ep_unique_id_t) -> Ctx,
    body: impl Fn(usize, &Ctx),
) {
    run_ranks_in_processes_killing(test, call, world, &[], join, body);
}

/// [`run_ranks_in_processes`] where the ranks in `killed` end their process
/// by SIGKILL (their body kills it, as a crash would): the call fails
/// unless exactly those ranks died by SIGKILL and every other rank passed.
pub fn run_ranks_in_processes_killing(
    test: &str,
    call: &str,
    world: usize,
    killed: &[usize],
    join: impl Fn(usize, ep_unique_id_t) -> Ctx,
    body: impl Fn(usize, &Ctx),
) {
    use std::os::unix::process::ExitStatusExt;
    if let Ok(this_call) = std::env::var(CALL_ENV) {
        if this_call == call {
            let rank: usize = std::env::var(RANK_ENV).unwrap().parse().unwrap();
            let hex = std::env::var(ID_ENV).unwrap();
            let mut id = ep_unique_id_t {
                internal: [0; EP_UNIQUE_ID_BYTES],
            };
            for (i, byte) in id.internal.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
            }
            body(rank, &join(rank, id));
        }
        return;
    }
    let id = unique_id();
    let hex: String = id.internal.iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().unwrap();
    let failed: Vec<String> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                // --nocapture: what the body prints reaches the pipe even if
                // the process dies.
                let child = std::process::Command::new(&exe)
                    .args([test, "--exact", "--include-ignored", "--test-threads=1"])
                    .arg("--nocapture")
                    .env(CALL_ENV, call)
                    .env(RANK_ENV, rank.to_string())
                    .env(ID_ENV, &hex)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap_or_else(|e| panic!("{call}: starting rank {rank}: {e}"));
                // One thread per rank drains its pipes: a rank blocked on a
                // full pipe would stall the others' collective calls.
                s.spawn(move || child.wait_with_output().unwrap())
            })
            .collect();
        ranks
            .into_iter()
            .enumerate()
            .filter_map(|(rank, t)| {
                let out = t.join().unwrap();
                let stdout = String::from_utf8_lossy(&out.stdout);
                for line in stdout
                    .lines()
                    .filter_map(|l| l.split_once(SHOWN).map(|(_, rest)| rest))
                {
                    println!("{call}: rank {rank}: {line}");
                }
                let (as_expected, expected) = if killed.contains(&rank) {
                    let by_sigkill = out.status.signal() == Some(libc::SIGKILL);
                    (by_sigkill, "expected: killed by SIGKILL")
                } else {
                    let ran = stdout.contains("test result: ok. 1 passed");
                    (out.status.success() && ran, "expected: passed")
                };
                (!as_expected).then(|| {
                    format!(
                        "rank {rank} ({}; {expected}):\n{stdout}{}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    )
                })
            })
            .collect()
    });
    assert!(failed.is_empty(), "{call}: {}", failed.join("\n"));
}

pub fn dispatch_args() -> ep_dispatch_args_t {
    let mut a = std::mem::MaybeUninit::uninit();
    // SAFETY: the init function fills the whole struct.
    unsafe {
        assert_eq!(ep_dispatch_args_init(a.as_mut_ptr()), EP_SUCCESS);
        a.assume_init()
    }
}

pub fn combine_args() -> ep_combine_args_t {
    let mut a = std::mem::MaybeUninit::uninit();
    // SAFETY: the init function fills the whole struct.
    unsafe {
        assert_eq!(ep_combine_args_init(a.as_mut_ptr()), EP_SUCCESS);
        a.assume_init()
    }
}

pub fn ll_dispatch_args() -> ep_ll_dispatch_args_t {
    let mut a = std::mem::MaybeUninit::uninit();
    // SAFETY: the init function fills the whole struct.
    unsafe {
        assert_eq!(ep_ll_dispatch_args_init(a.as_mut_ptr()), EP_SUCCESS);
        a.assume_init()
    }
}

pub fn ll_combine_args() -> ep_ll_combine_args_t {
    let mut a = std::mem::MaybeUninit::uninit();
    // SAFETY: the init function fills the whole struct.
    unsafe {
        assert_eq!(ep_ll_combine_args_init(a.as_mut_ptr()), EP_SUCCESS);
        a.assume_init()
    }
}

pub fn mega_args() -> ep_mega_args_t {
    let mut a = std::mem::MaybeUninit::uninit();
    // SAFETY: the init function fills the whole struct.
    unsafe {
        assert_eq!(ep_mega_args_init(a.as_mut_ptr()), EP_SUCCESS);
        a.assume_init()
    }
}
