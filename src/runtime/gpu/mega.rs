//! The fused kernels on GPUs: dispatch + grouped GEMM and grouped GEMM +
//! combine, each one persistent launch (kernels/mega.cu, whose comment
//! describes the protocol) between the normal mode's routing kernels.
//!
//! This side keeps the fused kernels' flags (a sequence number per row and
//! per tile, never cleared, see kernels/mega.cu), makes the TMA descriptors
//! of each call's rows and weights, and enqueues:
//! - dispatch + GEMM: count, stage, barrier, pull without the expert-major
//!   rows (the normal mode's, see `normal.rs`), the fused kernel, barrier;
//! - GEMM + combine: the fused kernel (GEMM and the combine's send), then
//!   the normal combine's barrier, reduce, barrier.

use super::normal::{CombineParams, DispatchParams, Dispatched, GpuHandle, NormalMode};
use super::{arg, check_aligned, ptr, Runtime};
use crate::error::{Error, Result};
use crate::reference::normal::worst_case_rows;
use crate::reference::Dtype;
use crate::runtime::backend::{HandleState, Stream};
use crate::runtime::config::{Config, MAX_EXPERT_ALIGNMENT};
use crate::runtime::cuda::{CUdevice_attribute, DeviceBuffer, TensorElement, TensorMap};
use crate::runtime::ops::{CombineOp, GemmOp, MegaCombineOp, MegaDispatchOp};
use std::os::raw::c_void;

/// Threads of a fused block (`EP_MEGA_THREADS`).
const THREADS: u32 = 384;
/// Rows of an m-tile (`EP_MEGA_BLOCK_M`).
const BLOCK_M: usize = 128;
/// Narrowest n-tile of the two kernels (FP8's 128; BF16's is 256).
const MIN_BLOCK_N: usize = 128;
/// k-block of each kernel (BF16 64, FP8 128) and n-tile (256, 128).
const BF16_BLOCK: (u32, u32) = (64, 256);
const FP8_BLOCK: (u32, u32) = (128, 128);
/// `MegaParams::mode` (`EP_MEGA_MODE_*`).
const MODE_DISPATCH: i32 = 0;
const MODE_COMBINE: i32 = 1;

/// Kernel parameters of the fused kernels; mirrors `MegaParams` in
/// kernels/mega.cu field by field (its static_asserts check the offsets).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct MegaParams {
    a: TensorMap,
    b: TensorMap,
    dispatch: DispatchParams,
    combine: CombineParams,
    y: u64,
    a_scales: u64,
    b_scales: u64,
    expert_layout: u64,
    row_ready: u64,
    tile_ready: u64,
    state: u64,
    abort_flag: u64,
    status: u64,
    timeout_ns: u64,
    rows: i64,
    mode: i32,
    n: i32,
    k: i32,
    local_experts: i32,
    max_m_tiles: i32,
    pad: i32,
}

/// The fused kernels' state of one context.
pub struct MegaMode {
    /// Hopper (compute capability 9.0): the only GPUs the kernels run on.
    hopper: bool,
    /// SMs of the device, and the shared memory one block may have.
    sms: u32,
    shared_bytes: u32,
    /// `[rows]` sequence number of the call that moved each expert-major row.
    row_ready: DeviceBuffer,
    /// `[max_m_tiles, hidden / 128]` sequence number of the call that stored
    /// each tile of a fused combine.
    tile_ready: DeviceBuffer,
    max_m_tiles: usize,
    /// `[2]` the last call's sequence number, blocks finished.
    state: DeviceBuffer,
}

/// The most m-tiles one call can have: every expert's last tile may be
/// partial.
fn max_m_tiles(cfg: &Config) -> usize {
    let (_, pairs) = worst_case_rows(cfg.topo, cfg.max_tokens, 1);
    pairs.div_ceil(BLOCK_M) + cfg.local_experts()
}

impl MegaMode {
    pub fn new(rt: &Runtime) -> Result<MegaMode> {
        let cfg = &rt.cfg;
        let device = &rt.device;
        let major =
            device.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor =
            device.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let shared = device
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let (_, rows) = worst_case_rows(cfg.topo, cfg.max_tokens, MAX_EXPERT_ALIGNMENT);
        let max_m_tiles = max_m_tiles(cfg);
        let n_tiles = cfg.topo.hidden.div_ceil(MIN_BLOCK_N);
        Ok(MegaMode {
            hopper: (major, minor) == (9, 0),
            sms: device.sm_count()?,
            shared_bytes: shared as u32,
            row_ready: DeviceBuffer::zeroed(device, rows * 4)?,
            tile_ready: DeviceBuffer::zeroed(device, max_m_tiles * n_tiles * 4)?,
            max_m_tiles,
            state: DeviceBuffer::zeroed(device, 2 * 4)?,
        })
    }

    fn check_supported(&self) -> Result<()> {
        if !self.hopper {
            return Err(Error::unsupported(
                "the fused kernels need a Hopper GPU (compute capability 9.0)",
            ));
        }
        Ok(())
    }

    /// `ep_mega_dispatch_gemm`.
    pub fn dispatch_gemm(
        &mut self,
        rt: &Runtime,
        normal: &NormalMode,
        op: &MegaDispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()> {
        self.check_supported()?;
        let handle = handle
            .downcast_mut::<GpuHandle>()
            .ok_or_else(|| Error::internal("not a GPU handle"))?;
        let d = &op.dispatch;
        let expert = d
            .expert
            .ok_or_else(|| Error::internal("a fused dispatch without expert-major rows"))?;
        if d.num_tokens > 0 {
            check_aligned("dispatch->x", d.x)?;
        }
        if let Some(recv) = &d.recv {
            check_aligned("dispatch->recv_x", recv.x)?;
        }
        check_aligned("dispatch->expert_x", expert.x)?;
        check_gemm_pointers(&op.gemm)?;
        handle.dispatched = None;
        let mut routing = normal.dispatch_params(rt, d, handle, false);
        routing.skip_expert_rows = 1;
        let mut params = self.params(rt, &op.gemm, expert.x, expert.scales, expert.capacity)?;
        params.mode = MODE_DISPATCH;
        params.dispatch = routing;
        params.expert_layout = handle.expert_layout.ptr();
        // SAFETY: the parameters describe the caller's arrays (valid until
        // the stream has run the kernels, API rule), the handle's and the
        // context's buffers.
        unsafe {
            normal.enqueue_routing(rt, &mut routing, d.num_tokens, stream)?;
            self.launch(rt, &op.gemm, &mut params, stream)?;
            rt.barrier(stream)?;
        }
        handle.dispatched = Some(Dispatched::on_device(d.num_tokens, Some(expert.capacity)));
        Ok(())
    }

    /// `ep_mega_gemm_combine`.
    pub fn gemm_combine(
        &mut self,
        rt: &Runtime,
        normal: &NormalMode,
        op: &MegaCombineOp,
        handle: &HandleState,
        stream: Stream,
    ) -> Result<()> {
        self.check_supported()?;
        let handle = handle
            .downcast_ref::<GpuHandle>()
            .ok_or_else(|| Error::internal("not a GPU handle"))?;
        let dispatched = handle
            .dispatched
            .as_ref()
            .ok_or_else(|| Error::invalid("the handle holds no successful dispatch"))?;
        let capacity = dispatched.expert_capacity.ok_or_else(|| {
            Error::invalid(
                "the handle's dispatch wrote no expert-major rows, which the fused combine multiplies",
            )
        })?;
        if dispatched.num_tokens > 0 && op.out.is_null() {
            return Err(Error::null("combine->out"));
        }
        check_aligned("combine->x", op.x)?;
        check_aligned("combine->out", op.out)?;
        check_gemm_pointers(&op.gemm)?;
        let combine = CombineOp {
            expert_major: true,
            x: op.gemm.y,
            out: op.out,
        };
        let mut reduce = normal.combine_params(rt, &combine, handle, dispatched);
        let mut params = self.params(rt, &op.gemm, op.x, op.x_scales, capacity)?;
        params.mode = MODE_COMBINE;
        params.combine = reduce;
        params.expert_layout = handle.expert_layout.ptr();
        // SAFETY: as in `dispatch_gemm`.
        unsafe {
            self.launch(rt, &op.gemm, &mut params, stream)?;
            normal.enqueue_reduce(rt, &mut reduce, stream)
        }
    }

    /// The parameters both kernels share, for the GEMM of `rows` rows at
    /// `x` (FP8 scales at `x_scales`).
    fn params(
        &self,
        rt: &Runtime,
        gemm: &GemmOp,
        x: *const u8,
        x_scales: *const f32,
        rows: usize,
    ) -> Result<MegaParams> {
        let cfg = &rt.cfg;
        let (element, size, (block_k, block_n)) = match gemm.dtype {
            Dtype::Bf16 => (TensorElement::Bf16, 2u64, BF16_BLOCK),
            Dtype::Fp8E4m3 => (TensorElement::Byte, 1u64, FP8_BLOCK),
        };
        let (n, k, experts) = (gemm.n as u64, gemm.k as u64, cfg.local_experts() as u64);
        let a = TensorMap::tiled(
            element,
            ptr(x),
            &[k, rows.max(1) as u64],
            &[k * size],
            &[block_k, BLOCK_M as u32],
        )?;
        let b = TensorMap::tiled(
            element,
            ptr(gemm.weights),
            &[k, n, experts],
            &[k * size, n * k * size],
            &[block_k, block_n, 1],
        )?;
        let fp8 = gemm.dtype == Dtype::Fp8E4m3;
        Ok(MegaParams {
            a,
            b,
            y: ptr(gemm.y),
            a_scales: if fp8 { ptr(x_scales) } else { 0 },
            b_scales: if fp8 { ptr(gemm.weight_scales) } else { 0 },
            row_ready: self.row_ready.ptr(),
            tile_ready: self.tile_ready.ptr(),
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

    /// Launches the fused kernel of the GEMM's type: one block per SM of
    /// the call's budget, the most shared memory a block may have.
    ///
    /// # Safety
    /// Every pointer in `params` must stay valid until the kernel has run.
    unsafe fn launch(
        &self,
        rt: &Runtime,
        gemm: &GemmOp,
        params: &mut MegaParams,
        stream: Stream,
    ) -> Result<()> {
        let name = match gemm.dtype {
            Dtype::Bf16 => "ep_mega_bf16_kernel",
            Dtype::Fp8E4m3 => "ep_mega_fp8_kernel",
        };
        let grid = match gemm.num_sms {
            0 => self.sms,
            budget => self.sms.min(budget as u32),
        };
        let kernel = rt.module.function(name)?;
        kernel.allow_dynamic_shared(self.shared_bytes)?;
        let mut p: *mut c_void = arg(params);
        // SAFETY: the parameter struct mirrors the kernel's `MegaParams`
        // (the caller vouches for the pointers).
        unsafe {
            kernel.launch(
                grid,
                THREADS,
                self.shared_bytes,
                stream as _,
                std::slice::from_mut(&mut p),
            )
        }
    }
}

/// The GPU backend's rules for a GEMM's arrays: 16-byte aligned (TMA and
/// the 16-byte row moves).
fn check_gemm_pointers(gemm: &GemmOp) -> Result<()> {
    check_aligned("weights", gemm.weights)?;
    check_aligned("y", gemm.y)?;
    if gemm.dtype == Dtype::Fp8E4m3 && !gemm.weight_scales.is_aligned() {
        return Err(Error::invalid("weight_scales is not 4-byte aligned"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn params_layout_matches_the_kernels() {
        // The same numbers are static_asserts in kernels/mega.cu.
        assert_eq!(size_of::<DispatchParams>(), 344);
        assert_eq!(size_of::<CombineParams>(), 120);
        assert_eq!(offset_of!(MegaParams, dispatch), 256);
        assert_eq!(offset_of!(MegaParams, combine), 600);
        assert_eq!(offset_of!(MegaParams, y), 720);
        assert_eq!(offset_of!(MegaParams, rows), 800);
        assert_eq!(offset_of!(MegaParams, mode), 808);
        assert_eq!(size_of::<MegaParams>(), 896);
    }
}
