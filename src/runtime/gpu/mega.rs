//! The fused kernels on GPUs: dispatch + grouped GEMM and grouped GEMM +
//! combine, each one persistent launch (kernels/mega.cu, whose comment
//! describes the protocol) between the normal mode's routing kernels.
//!
//! This side keeps the fused kernels' flags and counters (a sequence number
//! per row, never cleared; a combine's counts of stored tiles, which each
//! call's last block zeroes; see kernels/mega.cu), makes the TMA
//! descriptors of each call's rows and weights, and enqueues:
//! - dispatch + GEMM: count and stage, barrier, pull without the
//!   expert-major rows (the normal mode's, see `normal.rs`), the fused
//!   kernel;
//! - GEMM + combine: the fused kernel (the GEMM in column bands, each
//!   band's part of the combine's send once the band is stored), then the
//!   normal combine's barrier and reduce.
//!
//! Both leave their exchange open, like the normal mode's calls
//! (`normal::Exchange`): its closing barrier runs only before an exchange
//! of the same kind.

use super::normal::{combined, Dispatched, Exchange, GpuHandle, NormalMode};
use super::{ptr, Bound, Runtime};
use crate::abi::{
    MegaParams, MEGA_BF16_A_BOX_ROWS, MEGA_BF16_BLOCK_K, MEGA_BF16_BLOCK_N, MEGA_BLOCK_M,
    MEGA_FP8_A_BOX_ROWS, MEGA_FP8_BLOCK_K, MEGA_FP8_BLOCK_N, MEGA_MAX_BANDS, MEGA_MODE_COMBINE,
    MEGA_MODE_DISPATCH, MEGA_STORE_COLS, MEGA_STORE_ROWS, MEGA_THREADS,
};
use crate::error::{Error, Result};
use crate::reference::normal::worst_case_rows;
use crate::reference::Dtype;
use crate::runtime::backend::{HandleState, Stream};
use crate::runtime::config::{Config, MAX_EXPERT_ALIGNMENT};
use crate::runtime::cuda::{
    tensor_map, CUdevice_attribute, DeviceBuffer, Kernel, Module, TensorElement,
};
use crate::runtime::ops::{CombineOp, MegaCombineOp, MegaDispatchOp, MegaOp};
use crate::runtime::sequence::Call;

/// Blocks per cluster of the fused kernels unless `EP_MEGA_CLUSTER` says
/// otherwise: 1. Clusters of 2 load each weight tile once for both blocks
/// (half each, multicast); on 1 x H200 they were as fast or slower than
/// single blocks at every measured shape (bench/RESULTS.md, 2026-11-26), so
/// they stay opt-in.
const DEFAULT_CLUSTER: u32 = 1;

/// Column bands of a fused combine's GEMM unless `EP_MEGA_COMBINE_BANDS`
/// says otherwise: `BF16_BANDS` or `FP8_BANDS` for a dispatch of at least
/// `BANDED_MIN_TOKENS` tokens, else 1. The GEMM computes the bands one
/// after the other and the communication warps send each band's part of
/// the rows while the GEMM computes the next, so only the last band's send
/// follows the GEMM (kernels/mega.cu); each band reads the input rows once
/// more. On 1 x H200 (bench/RESULTS.md, 2026-11-27) the BF16 call at W3
/// (4096 tokens) took 1552 us in one band and 1503-1522 us in 2 to 8, the
/// FP8 call 1150 us in one band, 1118-1120 in 2, 1110-1112 in 3 and
/// 1126-1127 in 4 (its communication warps have 72 registers while the
/// GEMM runs: fewer loads in flight than BF16's, so more bands lag); at
/// decode (128 tokens, a send of a few microseconds) bands gain nothing.
const BF16_BANDS: u32 = 4;
const FP8_BANDS: u32 = 3;
const BANDED_MIN_TOKENS: usize = 1024;

/// The fused kernels (kernels/mega.cu): one per GEMM type, mode and
/// cluster size, so that each holds only its own mode's code.
pub struct MegaKernels {
    /// Single blocks, indexed [GEMM type][mode] (`Self::index`).
    single: [[Kernel<MegaParams>; 2]; 2],
    /// Clusters of 2 blocks, the same way.
    pair: [[Kernel<MegaParams>; 2]; 2],
}

impl MegaKernels {
    pub fn load(module: &Module) -> Result<MegaKernels> {
        Ok(MegaKernels {
            single: [
                [
                    module.function(c"ep_mega_bf16_dispatch_kernel")?,
                    module.function(c"ep_mega_bf16_combine_kernel")?,
                ],
                [
                    module.function(c"ep_mega_fp8_dispatch_kernel")?,
                    module.function(c"ep_mega_fp8_combine_kernel")?,
                ],
            ],
            pair: [
                [
                    module.function(c"ep_mega_bf16_dispatch_pair_kernel")?,
                    module.function(c"ep_mega_bf16_combine_pair_kernel")?,
                ],
                [
                    module.function(c"ep_mega_fp8_dispatch_pair_kernel")?,
                    module.function(c"ep_mega_fp8_combine_pair_kernel")?,
                ],
            ],
        })
    }

    /// The [GEMM type][mode] place of a kernel (`mode`: `MEGA_MODE_*`).
    fn index(dtype: Dtype, mode: i32) -> (usize, usize) {
        (
            usize::from(dtype == Dtype::Fp8E4m3),
            usize::from(mode == MEGA_MODE_COMBINE),
        )
    }

    /// The kernel of `dtype`'s GEMM in mode `mode`, for clusters of
    /// `cluster` blocks.
    fn pick(&self, dtype: Dtype, mode: i32, cluster: u32) -> &Kernel<MegaParams> {
        let (t, m) = Self::index(dtype, mode);
        if cluster > 1 {
            &self.pair[t][m]
        } else {
            &self.single[t][m]
        }
    }

    /// Every kernel.
    fn all(&self) -> impl Iterator<Item = &Kernel<MegaParams>> {
        self.single.iter().flatten().chain(self.pairs())
    }

    /// The kernels launched in clusters of 2.
    fn pairs(&self) -> impl Iterator<Item = &Kernel<MegaParams>> {
        self.pair.iter().flatten()
    }
}

/// The fused kernels' state of one context.
pub struct MegaMode {
    /// Hopper (compute capability 9.0): the only GPUs the kernels run on.
    hopper: bool,
    /// Blocks per cluster (1 or 2), and the most blocks one launch may have
    /// so that all are resident at once (a multiple of `cluster`).
    cluster: u32,
    max_blocks: u32,
    /// The shared memory one block may have.
    shared_bytes: u32,
    /// `[rows]` sequence number of the call that moved each expert-major row.
    row_ready: DeviceBuffer,
    /// `[max m-tiles]` sequence number of the call in which a producer saw
    /// every row of each m-tile moved.
    tile_ready: DeviceBuffer,
    /// `[1]` a combine's blocks whose GEMM tiles are stored (the call's
    /// last block zeroes it).
    gemm_count: DeviceBuffer,
    /// `[MEGA_MAX_BANDS]` a combine's units stored per column band (the
    /// call's last block zeroes them).
    band_count: DeviceBuffer,
    /// `EP_MEGA_COMBINE_BANDS`, when set.
    combine_bands: Option<u32>,
    /// The most m-tiles one call can have (the kernels refuse a layout
    /// with more).
    max_m_tiles: usize,
    /// `[3]` the last call's sequence number, blocks finished, units taken.
    state: DeviceBuffer,
}

/// The most m-tiles one call can have: every expert's last tile may be
/// partial, and its tiles are rounded up to a multiple of the cluster size.
fn max_m_tiles(cfg: &Config, cluster: usize) -> usize {
    let (_, pairs) = worst_case_rows(cfg.topo, cfg.max_tokens, 1);
    pairs.div_ceil(MEGA_BLOCK_M) + cluster * cfg.local_experts()
}

/// The number the environment variable `name` holds, if it is set: one of
/// `allowed`, else an error naming the variable.
fn env_number(name: &str, allowed: std::ops::RangeInclusive<u32>) -> Result<Option<u32>> {
    let Ok(value) = std::env::var(name) else {
        return Ok(None);
    };
    match value.trim().parse::<u32>() {
        Ok(number) if allowed.contains(&number) => Ok(Some(number)),
        _ => Err(Error::invalid(format!(
            "{name} = {value:?}: expected {} to {}",
            allowed.start(),
            allowed.end()
        ))),
    }
}

/// The cluster size to use: `EP_MEGA_CLUSTER` (1 or 2) when set, else
/// `DEFAULT_CLUSTER`.
fn cluster_size() -> Result<u32> {
    Ok(env_number("EP_MEGA_CLUSTER", 1..=2)?.unwrap_or(DEFAULT_CLUSTER))
}

/// A fused combine's column bands as `EP_MEGA_COMBINE_BANDS` (1 to
/// `MEGA_MAX_BANDS`) sets them, if it does.
fn combine_bands() -> Result<Option<u32>> {
    env_number("EP_MEGA_COMBINE_BANDS", 1..=MEGA_MAX_BANDS as u32)
}

impl MegaMode {
    pub fn new(rt: &Runtime) -> Result<MegaMode> {
        let cfg = &rt.cfg;
        let device = &rt.device;
        let hopper = device.compute_capability()? == (9, 0);
        let shared = device
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let (_, rows) = worst_case_rows(cfg.topo, cfg.max_tokens, MAX_EXPERT_ALIGNMENT);
        let cluster = cluster_size()?;
        let combine_bands = combine_bands()?;
        let max_m_tiles = max_m_tiles(cfg, cluster as usize);
        let shared = shared as u32;
        let mut max_blocks = device.sm_count()?;
        if hopper {
            let k = &rt.kernels;
            let bound = device.bind()?;
            for kernel in k.mega.all() {
                kernel.allow_dynamic_shared(&bound, shared)?;
            }
            if cluster > 1 {
                // Not every SM can host half of a cluster (SMs come in
                // groups): launch only the clusters that fit at once.
                let clusters = k
                    .mega
                    .pairs()
                    .map(|kernel| {
                        kernel.max_active_clusters(&bound, cluster, MEGA_THREADS as u32, shared)
                    })
                    .collect::<Result<Vec<u32>>>()?;
                // Ranks sharing the GPU split the clusters that fit, so
                // that all their persistent grids are resident at once.
                let ranks = rt.placement.sharing.len() as u32;
                let fit = clusters.into_iter().min().unwrap_or(0) / ranks;
                if fit == 0 {
                    return Err(Error::unsupported(format!(
                        "no cluster of the fused kernels fits on this GPU for each of its {ranks} \
                         ranks",
                    )));
                }
                max_blocks = max_blocks.min(fit * cluster);
            }
        }
        Ok(MegaMode {
            hopper,
            cluster,
            max_blocks,
            shared_bytes: shared,
            row_ready: DeviceBuffer::zeroed(device, rows * 4)?,
            tile_ready: DeviceBuffer::zeroed(device, max_m_tiles * 4)?,
            gemm_count: DeviceBuffer::zeroed(device, 4)?,
            band_count: DeviceBuffer::zeroed(device, MEGA_MAX_BANDS * 4)?,
            combine_bands,
            max_m_tiles,
            state: DeviceBuffer::zeroed(device, 3 * 4)?,
        })
    }

    /// Whether the fused kernels run on this GPU (checked before a fused
    /// call is made).
    pub fn check_supported(&self) -> Result<()> {
        if !self.hopper {
            return Err(Error::unsupported(
                "the fused kernels need a Hopper GPU (compute capability 9.0)",
            ));
        }
        Ok(())
    }

    /// `ep_mega_dispatch_gemm` (call `call`).
    pub fn dispatch_gemm(
        &mut self,
        rt: &Bound,
        normal: &mut NormalMode,
        call: Call,
        op: &MegaDispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()> {
        let handle = handle
            .downcast_mut::<GpuHandle>()
            .ok_or_else(|| Error::internal("not a GPU handle"))?;
        let d = &op.dispatch;
        let expert = d
            .expert
            .ok_or_else(|| Error::internal("a fused dispatch without expert-major rows"))?;
        handle.dispatched = None;
        let mut routing = normal.dispatch_params(rt, call, d, handle, false);
        routing.skip_expert_rows = 1;
        let mut params = self.params(rt, &op.gemm, expert.x, expert.scales, expert.capacity)?;
        params.mode = MEGA_MODE_DISPATCH;
        params.dispatch = routing;
        params.expert_layout = handle.expert_layout.ptr();
        // The pull runs alone between the count and the fused kernel: it
        // takes the fused call's SMs, not the normal mode's budget.
        let pull_grid = self.blocks(rt, &op.gemm);
        // SAFETY: the parameters describe the caller's arrays (valid until
        // the stream has run the kernels, API rule), the handle's and the
        // context's buffers.
        unsafe {
            normal.enqueue_routing(rt, &routing, d.num_tokens, pull_grid, stream)?;
            self.launch(rt, &op.gemm, &params, stream)?;
        }
        handle.dispatched = Some(Dispatched::on_device(d.num_tokens, Some(expert.capacity)));
        Ok(())
    }

    /// `ep_mega_gemm_combine` (call `call`).
    pub fn gemm_combine(
        &mut self,
        rt: &Bound,
        normal: &mut NormalMode,
        call: Call,
        op: &MegaCombineOp,
        handle: &HandleState,
        stream: Stream,
    ) -> Result<()> {
        // The context checked that the handle's dispatch made expert-major
        // rows.
        let (handle, dispatched) = combined(handle)?;
        let capacity = dispatched.expert_capacity.ok_or_else(|| {
            Error::internal(
                "the handle's dispatch wrote no expert-major rows, which the fused combine multiplies",
            )
        })?;
        // The combine reduces the GEMM's output rows.
        let combine = CombineOp {
            x: op.gemm.y,
            ..op.combine
        };
        let reduce = normal.combine_params(rt, call, &combine, handle, dispatched);
        let mut params = self.params(rt, &op.gemm, op.combine.x, op.gemm.x_scales, capacity)?;
        params.mode = MEGA_MODE_COMBINE;
        params.combine = reduce;
        params.bands = self.bands(op.gemm.dtype, dispatched.num_tokens) as i32;
        params.expert_layout = handle.expert_layout.ptr();
        // The reduce runs alone after the fused kernel, on its SMs (as the
        // pull of `dispatch_gemm`).
        let reduce_grid = self.blocks(rt, &op.gemm);
        // SAFETY: as in `dispatch_gemm`.
        unsafe {
            normal.open(rt, Exchange::Combine, stream)?;
            self.launch(rt, &op.gemm, &params, stream)?;
            normal.enqueue_reduce(rt, &reduce, reduce_grid, stream)
        }
    }

    /// The parameters both kernels share, for the GEMM of `rows` rows at
    /// `x` (FP8 scales at `x_scales`).
    fn params(
        &self,
        rt: &Runtime,
        gemm: &MegaOp,
        x: *const u8,
        x_scales: *const f32,
        rows: usize,
    ) -> Result<MegaParams> {
        let cfg = &rt.cfg;
        let (element, size, block_k, block_n, a_box_rows) = match gemm.dtype {
            Dtype::Bf16 => (
                TensorElement::Bf16,
                2u64,
                MEGA_BF16_BLOCK_K,
                MEGA_BF16_BLOCK_N,
                MEGA_BF16_A_BOX_ROWS,
            ),
            Dtype::Fp8E4m3 => (
                TensorElement::Byte,
                1u64,
                MEGA_FP8_BLOCK_K,
                MEGA_FP8_BLOCK_N,
                MEGA_FP8_A_BOX_ROWS,
            ),
        };
        // Each block of a cluster loads its share of the weight tile's rows.
        let (block_k, block_n) = (block_k as u32, block_n as u32 / self.cluster);
        let (n, k, experts) = (gemm.n as u64, gemm.k as u64, cfg.local_experts() as u64);
        let a = tensor_map(
            element,
            ptr(x),
            &[k, rows.max(1) as u64],
            &[k * size],
            &[block_k, a_box_rows as u32],
        )?;
        let b = tensor_map(
            element,
            ptr(gemm.weights),
            &[k, n, experts],
            &[k * size, n * k * size],
            &[block_k, block_n, 1],
        )?;
        let c = tensor_map(
            TensorElement::Bf16,
            ptr(gemm.y),
            &[n, rows.max(1) as u64],
            &[n * 2],
            &[MEGA_STORE_COLS as u32, MEGA_STORE_ROWS as u32],
        )?;
        let fp8 = gemm.dtype == Dtype::Fp8E4m3;
        Ok(MegaParams {
            a,
            b,
            c,
            y: ptr(gemm.y),
            a_scales: if fp8 { ptr(x_scales) } else { 0 },
            b_scales: if fp8 { ptr(gemm.weight_scales) } else { 0 },
            row_ready: self.row_ready.ptr(),
            tile_ready: self.tile_ready.ptr(),
            gemm_count: self.gemm_count.ptr(),
            band_count: self.band_count.ptr(),
            bands: 1,
            state: self.state.ptr(),
            abort_flag: rt.abort_ptr(),
            status: rt.status_ptr(),
            timeout_ns: rt.timeout_ns,
            rows: rows as i64,
            n: gemm.n as i32,
            k: gemm.k as i32,
            local_experts: cfg.local_experts() as i32,
            max_m_tiles: self.max_m_tiles as i32,
            ..MegaParams::default()
        })
    }

    /// The column bands of a fused combine's GEMM (`BF16_BANDS`,
    /// `FP8_BANDS`).
    fn bands(&self, dtype: Dtype, num_tokens: usize) -> u32 {
        self.combine_bands
            .unwrap_or(if num_tokens < BANDED_MIN_TOKENS {
                1
            } else if dtype == Dtype::Bf16 {
                BF16_BANDS
            } else {
                FP8_BANDS
            })
    }

    /// The SMs a fused call may use: its budget (`num_sms`, 0 for all), at
    /// most this rank's share of the GPU and the blocks that fit at once.
    /// The normal-mode kernels that run alone before or after the fused
    /// kernel (a dispatch's pull, a combine's reduce) take as many blocks:
    /// nothing else of the call runs beside them.
    fn blocks(&self, rt: &Runtime, gemm: &MegaOp) -> u32 {
        let blocks = self.max_blocks.min(rt.placement.sm_share());
        if gemm.num_sms > 0 {
            blocks.min(gemm.num_sms as u32)
        } else {
            blocks
        }
    }

    /// Launches the fused kernel of the GEMM's type: one block per SM of
    /// the call's budget (`blocks`), the most shared memory a block may
    /// have. Its blocks wait for each other, so they must all be resident:
    /// single blocks are launched cooperatively (the driver guarantees it),
    /// clusters only as many as fit at once.
    ///
    /// # Safety
    /// Every pointer in `params` must stay valid until the kernel has run.
    unsafe fn launch(
        &self,
        rt: &Bound,
        gemm: &MegaOp,
        params: &MegaParams,
        stream: Stream,
    ) -> Result<()> {
        let k = &rt.kernels;
        let kernel = k.mega.pick(gemm.dtype, params.mode, self.cluster);
        let grid = (self.blocks(rt, gemm) / self.cluster).max(1) * self.cluster;
        let threads = MEGA_THREADS as u32;
        let cooperative = self.cluster == 1;
        // SAFETY: the caller vouches for the pointers.
        unsafe {
            rt.launch_ex(
                cooperative,
                kernel,
                grid,
                threads,
                self.shared_bytes,
                stream,
                params,
            )
        }
    }
}
