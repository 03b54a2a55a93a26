//! Runs the kernels on GPU 0 and checks them against plain Rust. These tests
//! need a GPU, so they are ignored by default: on a GPU machine run
//! `cargo test --release --test gpu_kernels -- --ignored`.
//!
//! The barrier tests run one rank on one GPU and play the peers from the
//! host, by writing the peers' signals into this rank's array before the
//! launch: deterministic, and enough to check the protocol, the timeout and
//! the abort paths.

use std::mem::size_of_val;
use std::ptr;
use std::time::{Duration, Instant};

use ep::abi::{self, BarrierParams, LayoutParams, BARRIER_THREADS, LAYOUT_THREADS};
use ep::runtime::cuda::{
    CUdeviceptr, CUstream, Device, DeviceBuffer, DeviceStatus, MappedHost, Module, Plain,
};

/// The device's legacy default stream.
const STREAM: CUstream = ptr::null_mut();

fn gpu() -> (Device, Module) {
    let device = Device::new(0).expect("these tests need a CUDA GPU");
    let module = Module::load(&device).expect("loading the kernels");
    (device, module)
}

fn upload<T: Plain>(device: &Device, values: &[T]) -> DeviceBuffer {
    let buffer = DeviceBuffer::new(device, size_of_val(values)).unwrap();
    // SAFETY: synchronized before `values` can go away.
    unsafe {
        buffer.copy_from_host_async(values, STREAM).unwrap();
        device.stream_synchronize(STREAM).unwrap();
    }
    buffer
}

fn download<T: Plain + Default>(device: &Device, buffer: &DeviceBuffer, len: usize) -> Vec<T> {
    let mut values = vec![T::default(); len];
    // SAFETY: synchronized before `values` is read.
    unsafe {
        buffer.copy_to_host_async(&mut values, STREAM).unwrap();
        device.stream_synchronize(STREAM).unwrap();
    }
    values
}

// ---------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------

#[derive(Debug, PartialEq)]
struct Layout {
    tokens_per_rank: Vec<i32>,
    tokens_per_expert: Vec<i32>,
    is_token_in_rank: Vec<u8>,
}

/// What the layout kernel must compute; invalid ids, and ids a token lists
/// a second time, are skipped.
fn layout_on_host(topk_idx: &[i32], topk: usize, num_experts: usize, world: usize) -> Layout {
    let num_tokens = topk_idx.len() / topk;
    let experts_per_rank = num_experts / world;
    let mut layout = Layout {
        tokens_per_rank: vec![0; world],
        tokens_per_expert: vec![0; num_experts],
        is_token_in_rank: vec![0; num_tokens * world],
    };
    for (token, experts) in topk_idx.chunks(topk).enumerate() {
        for (slot, &expert) in experts.iter().enumerate() {
            let repeated = experts[..slot].contains(&expert);
            if expert >= 0 && (expert as usize) < num_experts && !repeated {
                layout.tokens_per_expert[expert as usize] += 1;
                layout.is_token_in_rank[token * world + expert as usize / experts_per_rank] = 1;
            }
        }
    }
    for token in 0..num_tokens {
        for rank in 0..world {
            layout.tokens_per_rank[rank] += layout.is_token_in_rank[token * world + rank] as i32;
        }
    }
    layout
}

fn layout_on_gpu(
    device: &Device,
    module: &Module,
    topk_idx: &[i32],
    topk: usize,
    num_experts: usize,
    world: usize,
) -> (Layout, DeviceStatus) {
    let num_tokens = topk_idx.len() / topk;
    let topk_buf = upload(device, topk_idx);
    let per_rank = DeviceBuffer::new(device, world * 4).unwrap();
    let per_expert = DeviceBuffer::new(device, num_experts * 4).unwrap();
    let in_rank = DeviceBuffer::new(device, num_tokens * world).unwrap();
    let status = MappedHost::<DeviceStatus>::new(device, 1).unwrap();
    let kernel = module
        .function::<LayoutParams>(c"ep_layout_kernel")
        .unwrap();
    let params = LayoutParams {
        topk_idx: topk_buf.ptr(),
        tokens_per_rank: per_rank.ptr(),
        tokens_per_expert: per_expert.ptr(),
        is_token_in_rank: in_rank.ptr(),
        status: status.device_ptr(),
        num_tokens: num_tokens as i32,
        topk: topk as i32,
        num_experts: num_experts as i32,
        world: world as i32,
    };
    // SAFETY: the parameters match the kernel's; the buffers outlive the
    // synchronize. Garbage first, to see that the kernel writes everything.
    unsafe {
        for buffer in [&per_rank, &per_expert, &in_rank] {
            buffer.memset_async(0xAB, STREAM).unwrap();
        }
        let bound = device.bind().unwrap();
        kernel
            .launch(
                &bound,
                world as u32,
                LAYOUT_THREADS as u32,
                0,
                STREAM,
                &params,
            )
            .unwrap();
        device.stream_synchronize(STREAM).unwrap();
    }
    let layout = Layout {
        tokens_per_rank: download(device, &per_rank, world),
        tokens_per_expert: download(device, &per_expert, num_experts),
        is_token_in_rank: download(device, &in_rank, num_tokens * world),
    };
    (layout, status.read(0))
}

/// Deterministic expert choices, about one slot in ten left empty (-1),
/// and none that repeats an earlier slot of its token (-1 instead).
fn routing(num_tokens: usize, topk: usize, num_experts: usize, seed: u64) -> Vec<i32> {
    let mut state = seed;
    let mut ids = Vec::with_capacity(num_tokens * topk);
    for i in 0..num_tokens * topk {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let draw = (state >> 33) as usize;
        let id = (draw % num_experts) as i32;
        let earlier = &ids[i - i % topk..];
        ids.push(if draw.is_multiple_of(10) || earlier.contains(&id) {
            -1
        } else {
            id
        });
    }
    ids
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn layout_matches_the_host() {
    let (device, module) = gpu();
    for (num_tokens, topk, num_experts, world) in [
        (300, 8, 64, 8),
        (4096, 16, 1024, 64),
        (1, 1, 1, 1),
        (1000, 2, 16, 16),
    ] {
        let topk_idx = routing(num_tokens, topk, num_experts, num_tokens as u64);
        let (layout, status) = layout_on_gpu(&device, &module, &topk_idx, topk, num_experts, world);
        assert_eq!(status, DeviceStatus::default());
        assert_eq!(
            layout,
            layout_on_host(&topk_idx, topk, num_experts, world),
            "{num_tokens} tokens, top-{topk}, {num_experts} experts, {world} ranks"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn layout_of_no_tokens_is_all_zero() {
    let (device, module) = gpu();
    let (layout, status) = layout_on_gpu(&device, &module, &[], 4, 32, 4);
    assert_eq!(status, DeviceStatus::default());
    assert_eq!(layout.tokens_per_rank, vec![0; 4]);
    assert_eq!(layout.tokens_per_expert, vec![0; 32]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn layout_reports_and_skips_invalid_expert_ids() {
    let (device, module) = gpu();
    let (topk, num_experts, world) = (4, 32, 4);
    let mut topk_idx = routing(100, topk, num_experts, 7);
    topk_idx[5 * topk + 3] = num_experts as i32;
    topk_idx[70 * topk] = -2;
    let (layout, status) = layout_on_gpu(&device, &module, &topk_idx, topk, num_experts, world);
    assert_eq!(status.code, abi::STATUS_INVALID_EXPERT);
    assert_eq!(status.phase, abi::PHASE_LAYOUT);
    assert!([5 * 4 + 3, 70 * 4].contains(&status.detail), "{status:?}");
    assert_eq!(layout, layout_on_host(&topk_idx, topk, num_experts, world));
}

/// A token that lists one expert twice counts once, as the dispatch routes
/// it, and the repeat is reported like any invalid id.
#[test]
#[ignore = "needs a CUDA GPU"]
fn layout_reports_and_skips_repeated_expert_ids() {
    let (device, module) = gpu();
    let (topk, num_experts, world) = (3, 8, 2);
    let topk_idx = [
        0, 5, 1, /* token 1 */ 6, 6, -1, /* token 2 */ 2, 3, 2,
    ];
    let (layout, status) = layout_on_gpu(&device, &module, &topk_idx, topk, num_experts, world);
    assert_eq!(status.code, abi::STATUS_INVALID_EXPERT);
    assert_eq!(status.phase, abi::PHASE_LAYOUT);
    assert!([4, 8].contains(&status.detail), "{status:?}");
    let want = layout_on_host(&topk_idx, topk, num_experts, world);
    assert_eq!(want.tokens_per_expert, [1, 1, 1, 1, 0, 1, 1, 0]);
    assert_eq!(want.tokens_per_rank, [2, 2]);
    assert_eq!(layout, want);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn layout_refuses_experts_that_do_not_split_over_ranks() {
    let (device, module) = gpu();
    let (_, status) = layout_on_gpu(&device, &module, &[0, 1], 2, 10, 4);
    assert_eq!(status.code, abi::STATUS_INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------
// Barrier
// ---------------------------------------------------------------------------

/// Bytes of one fake rank buffer: the signal slots, then the rank's barrier
/// and call words.
const RANK_BYTES: usize = 1024;

/// A call word (`abi::CALL_NUMBER_BITS`): operation `op`, call `number`.
fn call_word(op: i32, number: i32) -> i32 {
    op << abi::CALL_NUMBER_BITS | number
}

/// A barrier slot's value: `call` in the high half, `epoch` in the low half.
fn signal(epoch: i32, call: i32) -> u64 {
    (call as u32 as u64) << 32 | epoch as u32 as u64
}

/// The starts of the symmetric buffers of `world` ranks, all in this GPU's
/// memory (`RANK_BYTES` each: slots, barrier words, call words), and the
/// table of their addresses the kernel takes.
struct Signals {
    world: usize,
    buffers: DeviceBuffer,
    table: DeviceBuffer,
    abort: MappedHost<i32>,
    status: MappedHost<DeviceStatus>,
}

impl Signals {
    fn new(device: &Device, world: usize) -> Signals {
        const { assert!(abi::OPEN_EXCHANGE_OFFSET + 4 <= RANK_BYTES) };
        let buffers = upload(device, &vec![0u8; world * RANK_BYTES]);
        let table: Vec<CUdeviceptr> = (0..world)
            .map(|rank| buffers.ptr() + (rank * RANK_BYTES) as u64)
            .collect();
        Signals {
            world,
            table: upload(device, &table),
            buffers,
            abort: MappedHost::new(device, 1).unwrap(),
            status: MappedHost::new(device, 1).unwrap(),
        }
    }

    fn all(&self, device: &Device) -> Vec<u8> {
        download(device, &self.buffers, self.world * RANK_BYTES)
    }

    fn put(&self, device: &Device, all: &[u8]) {
        // SAFETY: synchronized before `all` goes away.
        unsafe {
            self.buffers.copy_from_host_async(all, STREAM).unwrap();
            device.stream_synchronize(STREAM).unwrap();
        }
    }

    /// Writes the i32s `values` at byte `offset` of rank `rank`'s buffer.
    fn set_words(&self, device: &Device, rank: usize, offset: usize, values: &[i32]) {
        let mut all = self.all(device);
        for (i, v) in values.iter().enumerate() {
            let at = rank * RANK_BYTES + offset + 4 * i;
            all[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        self.put(device, &all);
    }

    /// Sets rank `rank`'s slots (slot [p] = what rank p signalled).
    fn set(&self, device: &Device, rank: usize, slots: &[u64]) {
        let mut all = self.all(device);
        for (p, v) in slots.iter().enumerate() {
            let at = rank * RANK_BYTES + 8 * p;
            all[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        self.put(device, &all);
    }

    /// Publishes `word` as the call rank `rank` is in.
    fn set_call(&self, device: &Device, rank: usize, word: i32) {
        self.set_words(device, rank, abi::CALL_WORDS_OFFSET + 4, &[word]);
    }

    /// What every rank's slot [rank] holds: what `rank` signalled to each.
    fn signalled_by(&self, device: &Device, rank: usize) -> Vec<u64> {
        let all = self.all(device);
        (0..self.world)
            .map(|p| {
                let at = p * RANK_BYTES + 8 * rank;
                u64::from_le_bytes(all[at..at + 8].try_into().unwrap())
            })
            .collect()
    }

    /// Runs the barrier kernel for `rank` (rank 0's words outside the
    /// world) in the role `(role, exchange)` on the words as they are, to
    /// the end.
    fn run_barrier(
        &self,
        device: &Device,
        module: &Module,
        rank: usize,
        (role, exchange): (i32, i32),
        timeout: Duration,
    ) {
        let kernel = module
            .function::<BarrierParams>(c"ep_barrier_kernel")
            .unwrap();
        let own = self.table_entry(if rank < self.world { rank } else { 0 });
        let params = BarrierParams {
            peer_signals: self.table.ptr(),
            epoch_counter: own + abi::BARRIER_COUNTER_OFFSET as u64,
            open_exchange: own + abi::OPEN_EXCHANGE_OFFSET as u64,
            abort_flag: self.abort.device_ptr(),
            status: self.status.device_ptr(),
            timeout_ns: timeout.as_nanos() as u64,
            rank: rank as i32,
            world: self.world as i32,
            role,
            exchange,
        };
        // SAFETY: the parameters match the kernel's; everything outlives the
        // synchronize.
        unsafe {
            let bound = device.bind().unwrap();
            kernel
                .launch(&bound, 1, BARRIER_THREADS as u32, 0, STREAM, &params)
                .unwrap();
            device.stream_synchronize(STREAM).unwrap();
        }
    }

    /// The i32 at byte `offset` of rank `rank`'s buffer.
    fn word(&self, device: &Device, rank: usize, offset: usize) -> i32 {
        let at = rank * RANK_BYTES + offset;
        i32::from_le_bytes(self.all(device)[at..at + 4].try_into().unwrap())
    }

    /// Runs the barrier kernel for `rank` in call `call` as its barrier
    /// number `epoch` (its barrier words say `passed` barriers were passed)
    /// and returns its status and how long it took.
    fn barrier_after(
        &self,
        device: &Device,
        module: &Module,
        rank: usize,
        (epoch, passed, call): (i32, i32, i32),
        timeout: Duration,
    ) -> (DeviceStatus, Duration) {
        // A rank outside the world (refused by the kernel) gets rank 0's words.
        let own = if rank < self.world { rank } else { 0 };
        self.set_words(
            device,
            own,
            abi::BARRIER_COUNTER_OFFSET,
            &[epoch - 1, passed],
        );
        self.set_call(device, own, call);
        let plain = (abi::BARRIER_PLAIN, abi::EXCHANGE_NONE);
        let start = Instant::now();
        self.run_barrier(device, module, rank, plain, timeout);
        let elapsed = start.elapsed();
        let status = self.status.read(0);
        if status.code == abi::STATUS_OK && passed == epoch - 1 {
            let at = own * RANK_BYTES + abi::BARRIER_COUNTER_OFFSET;
            let words = &self.all(device)[at..at + 8];
            assert_eq!(words[..4], epoch.to_le_bytes(), "epoch count");
            assert_eq!(words[4..], epoch.to_le_bytes(), "last barrier passed");
        }
        (status, elapsed)
    }

    /// `barrier_after` with every earlier barrier passed.
    fn barrier(
        &self,
        device: &Device,
        module: &Module,
        rank: usize,
        epoch: i32,
        call: i32,
        timeout: Duration,
    ) -> (DeviceStatus, Duration) {
        self.barrier_after(device, module, rank, (epoch, epoch - 1, call), timeout)
    }

    fn table_entry(&self, rank: usize) -> u64 {
        self.buffers.ptr() + (rank * RANK_BYTES) as u64
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn barrier_passes_when_every_peer_has_arrived() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 4);
    let rank = 1;
    let call = call_word(1, 9);
    // Peers 0 and 3 signalled epoch 1 in this call, peer 2 is already at
    // epoch 2 (one barrier ahead, in its next call); slot [1] is this
    // rank's own and is set by the kernel.
    let next = call_word(2, 10);
    signals.set(
        &device,
        rank,
        &[signal(1, call), 0, signal(2, next), signal(1, call)],
    );
    let (status, _) = signals.barrier(&device, &module, rank, 1, call, Duration::from_secs(5));
    assert_eq!(status, DeviceStatus::default());
    assert_eq!(
        signals.signalled_by(&device, rank),
        vec![signal(1, call); 4]
    );

    let single = Signals::new(&device, 1);
    let (status, _) = single.barrier(&device, &module, 0, 1, call, Duration::from_secs(5));
    assert_eq!(status, DeviceStatus::default());
}

/// The normal mode's closing barriers run only when an exchange of their
/// kind is open (kernels/barrier.cu, "Roles"); a skipped one counts no
/// epoch, so every rank's epochs stay in step.
#[test]
#[ignore = "needs a CUDA GPU"]
fn closing_barriers_run_only_for_an_open_exchange_of_their_kind() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 1);
    let timeout = Duration::from_secs(5);
    let (epochs, open) = (abi::BARRIER_COUNTER_OFFSET, abi::OPEN_EXCHANGE_OFFSET);
    let (dispatch, combine) = (abi::EXCHANGE_DISPATCH, abi::EXCHANGE_COMBINE);
    // (role, exchange), then the epoch count and the open exchange after it.
    for (step, (role, exchange, count, open_after)) in [
        (abi::BARRIER_CLOSING, dispatch, 0, abi::EXCHANGE_NONE),
        (abi::BARRIER_MIDDLE, dispatch, 1, dispatch),
        (abi::BARRIER_CLOSING, combine, 1, dispatch),
        (abi::BARRIER_MIDDLE, combine, 2, combine),
        (abi::BARRIER_CLOSING, combine, 3, abi::EXCHANGE_NONE),
        (abi::BARRIER_CLOSING, combine, 3, abi::EXCHANGE_NONE),
        (
            abi::BARRIER_PLAIN,
            abi::EXCHANGE_NONE,
            4,
            abi::EXCHANGE_NONE,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        signals.run_barrier(&device, &module, 0, (role, exchange), timeout);
        assert_eq!(signals.status.read(0).code, abi::STATUS_OK, "step {step}");
        assert_eq!(
            signals.word(&device, 0, epochs),
            count,
            "step {step}: epochs"
        );
        assert_eq!(
            signals.word(&device, 0, epochs + 4),
            count,
            "step {step}: passed"
        );
        assert_eq!(
            signals.word(&device, 0, open),
            open_after,
            "step {step}: open"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn barrier_times_out_naming_the_missing_peer() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 4);
    let call = call_word(1, 3);
    signals.set(
        &device,
        0,
        &[0, signal(5, call), signal(4, call), signal(5, call)],
    );
    let (status, took) = signals.barrier(&device, &module, 0, 5, call, Duration::from_millis(20));
    let expected = DeviceStatus {
        code: abi::STATUS_TIMEOUT,
        rank: 2,
        phase: abi::PHASE_BARRIER,
        detail: 4,
        call,
        awaited: 5,
    };
    assert_eq!(status, expected);
    assert!(took < Duration::from_secs(2), "{took:?}");
    // The peers were still told that rank 0 arrived.
    assert_eq!(signals.signalled_by(&device, 0), vec![signal(5, call); 4]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn barrier_stops_when_the_host_aborts() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 2);
    signals.abort.write(0, 1);
    let (status, took) = signals.barrier(
        &device,
        &module,
        0,
        1,
        call_word(1, 1),
        Duration::from_secs(60),
    );
    assert_eq!(status.code, abi::STATUS_ABORTED);
    assert_eq!(status.rank, 1);
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn barrier_refuses_a_rank_outside_the_world() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 2);
    let (status, _) = signals.barrier(
        &device,
        &module,
        2,
        1,
        call_word(1, 1),
        Duration::from_secs(1),
    );
    assert_eq!(status.code, abi::STATUS_INVALID_ARGUMENT);
}

/// A peer at the same barrier but in another call (a combine where this
/// rank dispatches): a mismatch at once, naming both calls.
#[test]
#[ignore = "needs a CUDA GPU"]
fn barrier_reports_a_peer_in_another_call() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 2);
    let (mine, theirs) = (call_word(1, 4), call_word(2, 4));
    signals.set(&device, 0, &[0, signal(3, theirs)]);
    let (status, took) = signals.barrier(&device, &module, 0, 3, mine, Duration::from_secs(60));
    let expected = DeviceStatus {
        code: abi::STATUS_MISMATCH,
        rank: 1,
        phase: abi::PHASE_BARRIER,
        detail: theirs,
        call: mine,
        awaited: 0,
    };
    assert_eq!(status, expected);
    assert!(took < Duration::from_secs(5), "{took:?}");
}

/// A peer that never comes because it is in a later call (or in a call of
/// the low-latency mode, which has no barriers, under this call's number):
/// the wait reads its published call word and ends long before the timeout.
#[test]
#[ignore = "needs a CUDA GPU"]
fn barrier_ends_when_a_peer_is_in_a_call_without_it() {
    let (device, module) = gpu();
    let mine = call_word(1, 4);
    for theirs in [call_word(1, 5), call_word(3, 4)] {
        let signals = Signals::new(&device, 2);
        signals.set_call(&device, 1, theirs);
        let (status, took) = signals.barrier(&device, &module, 0, 3, mine, Duration::from_secs(60));
        assert_eq!(status.code, abi::STATUS_MISMATCH, "{theirs:x}");
        assert_eq!((status.rank, status.detail, status.call), (1, theirs, mine));
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
    // A peer in an earlier call is only slow: the wait goes on (to its
    // timeout here).
    let signals = Signals::new(&device, 2);
    signals.set_call(&device, 1, call_word(2, 3));
    let (status, _) = signals.barrier(&device, &module, 0, 3, mine, Duration::from_millis(50));
    assert_eq!(status.code, abi::STATUS_TIMEOUT);
}

/// After a failed barrier a rank signals no later barrier, so its peers
/// stop too instead of passing with data of a failed call.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_barrier_after_a_failed_one_signals_nothing() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 2);
    let call = call_word(2, 8);
    signals.set(&device, 0, &[0, signal(7, call)]);
    // Barrier 6 was entered but not passed.
    let (status, _) =
        signals.barrier_after(&device, &module, 0, (7, 5, call), Duration::from_secs(60));
    assert_eq!(status, DeviceStatus::default());
    assert_eq!(signals.signalled_by(&device, 0), vec![0, 0]);
}

/// Two ranks sharing this GPU, each on its own stream, run 60 barriers in a
/// row; one arrives first and waits (up to 5 ms, so past the waits' host
/// polling interval) for the other, in both orders. Every barrier must pass:
/// a waiting rank sees a peer's signal that arrives while it waits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn barriers_of_two_ranks_sharing_the_gpu_pass_in_any_order() {
    let (device, module) = gpu();
    let kernel = module
        .function::<BarrierParams>(c"ep_barrier_kernel")
        .unwrap();
    let signals = Signals::new(&device, 2);
    let call = call_word(2, 1);
    signals.set_call(&device, 0, call);
    signals.set_call(&device, 1, call);
    let bound = device.bind().unwrap();
    let streams: Vec<CUstream> = (0..2)
        .map(|_| {
            let mut stream = ptr::null_mut();
            // SAFETY: creates a stream of the bound context.
            let res = unsafe {
                cudarc::driver::sys::cuStreamCreate(
                    &mut stream,
                    cudarc::driver::sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            };
            assert_eq!(res, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
            stream
        })
        .collect();
    let params = |rank: usize| BarrierParams {
        peer_signals: signals.table.ptr(),
        epoch_counter: signals.table_entry(rank) + abi::BARRIER_COUNTER_OFFSET as u64,
        open_exchange: signals.table_entry(rank) + abi::OPEN_EXCHANGE_OFFSET as u64,
        abort_flag: signals.abort.device_ptr(),
        status: signals.status.device_ptr(),
        timeout_ns: Duration::from_secs(5).as_nanos() as u64,
        rank: rank as i32,
        world: 2,
        role: abi::BARRIER_PLAIN,
        exchange: abi::EXCHANGE_NONE,
    };
    for round in 0..60 {
        let first = round % 2;
        let delay = Duration::from_micros([0, 50, 500, 5000][round / 2 % 4]);
        for (i, rank) in [first, 1 - first].into_iter().enumerate() {
            if i == 1 {
                std::thread::sleep(delay);
            }
            // SAFETY: the parameters match the kernel's; everything
            // outlives the synchronize below.
            unsafe {
                kernel
                    .launch(
                        &bound,
                        1,
                        BARRIER_THREADS as u32,
                        0,
                        streams[rank],
                        &params(rank),
                    )
                    .unwrap();
            }
        }
        for &stream in &streams {
            // SAFETY: a stream of this device.
            unsafe { device.stream_synchronize(stream).unwrap() };
        }
        assert_eq!(
            signals.status.read(0),
            DeviceStatus::default(),
            "round {round}: rank {first} first, the other {delay:?} later"
        );
    }
    for stream in streams {
        // SAFETY: a stream made above, idle after the synchronize.
        unsafe { cudarc::driver::sys::cuStreamDestroy_v2(stream) };
    }
}
