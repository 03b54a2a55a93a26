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

/// What the layout kernel must compute; invalid ids are skipped.
fn layout_on_host(topk_idx: &[i32], topk: usize, num_experts: usize, world: usize) -> Layout {
    let num_tokens = topk_idx.len() / topk;
    let experts_per_rank = num_experts / world;
    let mut layout = Layout {
        tokens_per_rank: vec![0; world],
        tokens_per_expert: vec![0; num_experts],
        is_token_in_rank: vec![0; num_tokens * world],
    };
    for (token, experts) in topk_idx.chunks(topk).enumerate() {
        for &expert in experts {
            if expert >= 0 && (expert as usize) < num_experts {
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

/// Deterministic expert choices, about one slot in ten left empty (-1).
fn routing(num_tokens: usize, topk: usize, num_experts: usize, seed: u64) -> Vec<i32> {
    let mut state = seed;
    (0..num_tokens * topk)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let draw = (state >> 33) as usize;
            if draw.is_multiple_of(10) {
                -1
            } else {
                (draw % num_experts) as i32
            }
        })
        .collect()
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

/// The signal arrays of `world` ranks, all in this GPU's memory, and the
/// table of their addresses the kernel takes.
struct Signals {
    world: usize,
    arrays: DeviceBuffer,
    table: DeviceBuffer,
    abort: MappedHost<i32>,
    status: MappedHost<DeviceStatus>,
}

impl Signals {
    fn new(device: &Device, world: usize) -> Signals {
        let arrays = upload(device, &vec![0i32; world * world]);
        let table: Vec<CUdeviceptr> = (0..world)
            .map(|rank| arrays.ptr() + (rank * world * 4) as u64)
            .collect();
        Signals {
            world,
            table: upload(device, &table),
            arrays,
            abort: MappedHost::new(device, 1).unwrap(),
            status: MappedHost::new(device, 1).unwrap(),
        }
    }

    /// Sets rank `rank`'s array (slot [p] = what rank p signalled).
    fn set(&self, device: &Device, rank: usize, slots: &[i32]) {
        let mut all: Vec<i32> = download(device, &self.arrays, self.world * self.world);
        all[rank * self.world..][..self.world].copy_from_slice(slots);
        // SAFETY: synchronized before `all` goes away.
        unsafe {
            self.arrays.copy_from_host_async(&all, STREAM).unwrap();
            device.stream_synchronize(STREAM).unwrap();
        }
    }

    /// What every rank's slot [rank] holds: what `rank` signalled to each.
    fn signalled_by(&self, device: &Device, rank: usize) -> Vec<i32> {
        let all: Vec<i32> = download(device, &self.arrays, self.world * self.world);
        (0..self.world)
            .map(|p| all[p * self.world + rank])
            .collect()
    }

    /// Runs the barrier kernel for `rank` as its barrier number `epoch` and
    /// returns its status and how long it took.
    fn barrier(
        &self,
        device: &Device,
        module: &Module,
        rank: usize,
        epoch: i32,
        timeout: Duration,
    ) -> (DeviceStatus, Duration) {
        let kernel = module
            .function::<BarrierParams>(c"ep_barrier_kernel")
            .unwrap();
        let counter = upload(device, &[epoch - 1, epoch - 1]);
        let params = BarrierParams {
            peer_signals: self.table.ptr(),
            epoch_counter: counter.ptr(),
            abort_flag: self.abort.device_ptr(),
            status: self.status.device_ptr(),
            timeout_ns: timeout.as_nanos() as u64,
            rank: rank as i32,
            world: self.world as i32,
        };
        let start = Instant::now();
        // SAFETY: the parameters match the kernel's; everything outlives the
        // synchronize.
        unsafe {
            let bound = device.bind().unwrap();
            kernel
                .launch(&bound, 1, BARRIER_THREADS as u32, 0, STREAM, &params)
                .unwrap();
            device.stream_synchronize(STREAM).unwrap();
        }
        let elapsed = start.elapsed();
        let status = self.status.read(0);
        if status.code == abi::STATUS_OK {
            assert_eq!(
                download::<i32>(device, &counter, 1),
                vec![epoch],
                "epoch count"
            );
        }
        (status, elapsed)
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn barrier_passes_when_every_peer_has_arrived() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 4);
    let rank = 1;
    // Peers 0 and 3 signalled epoch 1, peer 2 is already at epoch 2 (one
    // barrier ahead); slot [1] is this rank's own and is set by the kernel.
    signals.set(&device, rank, &[1, 0, 2, 1]);
    let (status, _) = signals.barrier(&device, &module, rank, 1, Duration::from_secs(5));
    assert_eq!(status, DeviceStatus::default());
    assert_eq!(signals.signalled_by(&device, rank), vec![1; 4]);

    let single = Signals::new(&device, 1);
    let (status, _) = single.barrier(&device, &module, 0, 1, Duration::from_secs(5));
    assert_eq!(status, DeviceStatus::default());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn barrier_times_out_naming_the_missing_peer() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 4);
    signals.set(&device, 0, &[0, 5, 4, 5]);
    let (status, took) = signals.barrier(&device, &module, 0, 5, Duration::from_millis(20));
    let expected = DeviceStatus {
        code: abi::STATUS_TIMEOUT,
        rank: 2,
        phase: abi::PHASE_BARRIER,
        detail: 4,
    };
    assert_eq!(status, expected);
    assert!(took < Duration::from_secs(2), "{took:?}");
    // The peers were still told that rank 0 arrived.
    assert_eq!(signals.signalled_by(&device, 0), vec![5; 4]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn barrier_stops_when_the_host_aborts() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 2);
    signals.abort.write(0, 1);
    let (status, took) = signals.barrier(&device, &module, 0, 1, Duration::from_secs(60));
    assert_eq!(status.code, abi::STATUS_ABORTED);
    assert_eq!(status.rank, 1);
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn barrier_refuses_a_rank_outside_the_world() {
    let (device, module) = gpu();
    let signals = Signals::new(&device, 2);
    let (status, _) = signals.barrier(&device, &module, 2, 1, Duration::from_secs(1));
    assert_eq!(status.code, abi::STATUS_INVALID_ARGUMENT);
}
