//! Every operation as a ready call: its C arguments, its buffers in any
//! memory ([`Mem`]: host memory for the host backend, device memory in a GPU
//! test), its reference result, and access to each pointer field by its C
//! name. The contract walk ([`super::walk`]) and the API fuzz drive these.
//!
//! Inputs come from seeds, so every rank rebuilds every rank's inputs and
//! computes the reference of its own outputs.

use super::{bits, dtype_code, dtype_of, random_bf16, routing, weights, Ctx, Rng, POISON};
use ep::capi::*;
use ep::reference::fp8::quantize_rows;
use ep::reference::layout::dispatch_layout;
use ep::reference::low_latency::{
    ll_combine, ll_dispatch, LlDispatched, LlExpertOutputs, LlRankTokens,
};
use ep::reference::normal::{self, Dispatched, RankTokens, Returned};
use ep::reference::{Dtype, Topology};
use half::bf16;
use std::cell::UnsafeCell;
use std::ptr::null_mut;

/// A buffer the library reads or writes.
pub trait Buf {
    fn ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
    /// Overwrites the start of the buffer with `data`.
    fn write(&self, data: &[u8]);
    /// The whole buffer, once the library's work on it has finished.
    fn read(&self) -> Vec<u8>;
    /// Fills the buffer with [`POISON`].
    fn poison(&self);
}

/// Where a test's buffers live.
pub trait Mem: Sync {
    /// `bytes` of [`POISON`] (at least 16 bytes, 16-byte aligned).
    fn alloc(&self, bytes: usize) -> Box<dyn Buf>;
    /// Copies `data` to `ptr`, memory the library gave out (the
    /// low-latency combine buffer).
    fn write_at(&self, ptr: *mut u8, data: &[u8]);
    /// Largest difference accepted between a combine's BF16 output and the
    /// reference, relative to the reference's magnitude (0: bit-exact).
    fn combine_tolerance(&self) -> f32 {
        0.0
    }
    /// What the fused calls (`ep_mega_*`) return when they are correct:
    /// `EP_ERR_UNSUPPORTED` where they do not run (a GPU other than Hopper).
    fn fused_status(&self) -> ep_status_t {
        EP_SUCCESS
    }
    /// The stream the calls run on (NULL, the legacy default stream, unless
    /// the memory says otherwise).
    fn stream(&self) -> ep_stream_t {
        null_mut()
    }
}

/// Host memory: what the host backend reads and writes.
pub struct HostMem;

struct HostBuf {
    /// `u128` elements keep the buffer 16-byte aligned.
    data: UnsafeCell<Vec<u128>>,
    bytes: usize,
}

impl Buf for HostBuf {
    fn ptr(&self) -> *mut u8 {
        // SAFETY: the vector lives as long as the buffer.
        unsafe { (*self.data.get()).as_mut_ptr() as *mut u8 }
    }
    fn len(&self) -> usize {
        self.bytes
    }
    fn write(&self, data: &[u8]) {
        assert!(data.len() <= self.bytes, "write past a buffer");
        // SAFETY: in bounds; the library is not running.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr(), data.len()) }
    }
    fn read(&self) -> Vec<u8> {
        // SAFETY: in bounds.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.bytes).to_vec() }
    }
    fn poison(&self) {
        // SAFETY: in bounds.
        unsafe { std::ptr::write_bytes(self.ptr(), POISON, self.bytes) }
    }
}

impl Mem for HostMem {
    fn alloc(&self, bytes: usize) -> Box<dyn Buf> {
        let buf = HostBuf {
            data: UnsafeCell::new(vec![0; bytes.max(16).div_ceil(16)]),
            bytes: bytes.max(16),
        };
        buf.poison();
        Box::new(buf)
    }
    fn write_at(&self, ptr: *mut u8, data: &[u8]) {
        // SAFETY: the caller passes memory the library gave out, with room.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len()) }
    }
}

pub fn to_bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: reads the plain bytes of `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
        .to_vec()
}

pub fn from_bytes<T: Copy>(b: &[u8]) -> Vec<T> {
    let n = b.len() / std::mem::size_of::<T>();
    // SAFETY: `n` whole elements; the element types used accept any bits.
    (0..n)
        .map(|i| unsafe { (b.as_ptr() as *const T).add(i).read_unaligned() })
        .collect()
}

/// An args struct whose pointer fields can be reached by their C names.
pub trait PointerFields: Copy {
    /// The field `name`, as an untyped pointer slot; panics for a name the
    /// struct lacks.
    fn slot(&mut self, name: &str) -> *mut *mut u8;
}

macro_rules! pointer_fields {
    ($t:ty { $($f:ident),* } $( , $inner:ident : $($g:ident),* )*) => {
        impl PointerFields for $t {
            fn slot(&mut self, name: &str) -> *mut *mut u8 {
                match name {
                    $(stringify!($f) => std::ptr::addr_of_mut!(self.$f) as *mut *mut u8,)*
                    $($(stringify!($g) => std::ptr::addr_of_mut!(self.$inner.$g) as *mut *mut u8,)*)*
                    other => panic!("{} has no pointer field `{other}`", stringify!($t)),
                }
            }
        }
    };
}

pointer_fields!(ep_dispatch_args_t {
    x,
    x_scales,
    topk_idx,
    topk_weights,
    recv_x,
    recv_x_scales,
    recv_topk_idx,
    recv_topk_weights,
    recv_src_info,
    recv_num_tokens,
    expert_x,
    expert_x_scales,
    expert_weights,
    expert_src_row,
    expert_offsets,
    expert_counts,
    host_recv_num_tokens,
    host_expert_counts
});
pointer_fields!(ep_combine_args_t { x, out });
pointer_fields!(ep_ll_dispatch_args_t {
    x,
    topk_idx,
    topk_weights,
    recv_x,
    recv_x_scales,
    recv_count,
    recv_src_info,
    recv_layout_range,
    device_num_tokens
});
pointer_fields!(ep_ll_combine_args_t {
    x,
    topk_idx,
    topk_weights,
    src_info,
    layout_range,
    out,
    device_num_tokens
});

/// The arguments of `ep_get_dispatch_layout`, as a struct.
#[derive(Clone, Copy)]
pub struct LayoutArgs {
    pub num_tokens: i32,
    pub topk_idx: *const i32,
    pub num_tokens_per_rank: *mut i32,
    pub num_tokens_per_expert: *mut i32,
    pub is_token_in_rank: *mut u8,
}

pointer_fields!(LayoutArgs {
    topk_idx,
    num_tokens_per_rank,
    num_tokens_per_expert,
    is_token_in_rank
});

/// The megakernels' args with their halves, whose pointer names are their
/// own (`dispatch`, `combine`, `weights`, `weight_scales`, `y`, and
/// `x_scales` of the combine) and those of the half a call uses. The
/// `dispatch` and `combine` slots hold a marker while set (the struct is
/// moved): [`MegaArgs::c_args`] points them at the halves.
#[derive(Clone, Copy)]
pub struct MegaArgs {
    pub args: ep_mega_args_t,
    pub dispatch: ep_dispatch_args_t,
    pub combine: ep_combine_args_t,
    /// The call is `ep_mega_gemm_combine`.
    pub is_combine: bool,
}

impl MegaArgs {
    /// A marker for a set `dispatch` or `combine` slot.
    pub fn marker<T>() -> *const T {
        std::ptr::NonNull::dangling().as_ptr()
    }

    /// The args to pass: the set halves pointed at `self`'s.
    pub fn c_args(&self) -> ep_mega_args_t {
        let mut a = self.args;
        if !a.dispatch.is_null() {
            a.dispatch = &self.dispatch;
        }
        if !a.combine.is_null() {
            a.combine = &self.combine;
        }
        a
    }
}

impl PointerFields for MegaArgs {
    fn slot(&mut self, name: &str) -> *mut *mut u8 {
        let a = &mut self.args;
        match name {
            "dispatch" => std::ptr::addr_of_mut!(a.dispatch) as *mut *mut u8,
            "combine" => std::ptr::addr_of_mut!(a.combine) as *mut *mut u8,
            "weights" => std::ptr::addr_of_mut!(a.weights) as *mut *mut u8,
            "weight_scales" => std::ptr::addr_of_mut!(a.weight_scales) as *mut *mut u8,
            "y" => std::ptr::addr_of_mut!(a.y) as *mut *mut u8,
            "x_scales" if self.is_combine => std::ptr::addr_of_mut!(a.x_scales) as *mut *mut u8,
            other if self.is_combine => self.combine.slot(other),
            other => self.dispatch.slot(other),
        }
    }
}

/// One call's arguments and the buffers its pointers point to.
pub struct Call<'m, A> {
    pub args: A,
    /// The arguments as built, which [`Call::restore`] returns to.
    saved: Option<A>,
    mem: &'m dyn Mem,
    /// (field, buffer, is an output).
    bufs: Vec<(&'static str, Box<dyn Buf>, bool)>,
    /// Buffers of replaced inputs ([`Call::replace`]), kept alive.
    extra: Vec<Box<dyn Buf>>,
}

impl<'m, A: PointerFields> Call<'m, A> {
    /// The stream the call runs on (see `Mem::stream`).
    pub fn stream(&self) -> ep_stream_t {
        self.mem.stream()
    }

    pub fn new(mem: &'m dyn Mem, args: A) -> Self {
        Call {
            args,
            saved: None,
            mem,
            bufs: Vec::new(),
            extra: Vec::new(),
        }
    }

    /// Remembers the arguments as they are now, for [`Call::restore`].
    pub fn save(&mut self) {
        self.saved = Some(self.args);
    }

    /// The same buffers with other arguments (`args`' pointers are set to
    /// them, by field name).
    pub fn into_args<B: PointerFields>(self, args: B) -> Call<'m, B> {
        let mut call = Call {
            args,
            saved: None,
            mem: self.mem,
            bufs: self.bufs,
            extra: self.extra,
        };
        call.restore();
        call
    }

    /// Points field `name` to a modified copy of its input (the original
    /// stays, for [`Call::restore`]).
    pub fn replace<T: Copy>(&mut self, name: &str, change: impl FnOnce(&mut Vec<T>)) {
        let mut values: Vec<T> = from_bytes(&self.buf(name).read());
        change(&mut values);
        let bytes = to_bytes(&values);
        let buf = self.mem.alloc(bytes.len());
        buf.write(&bytes);
        self.set(name, buf.ptr());
        self.extra.push(buf);
    }

    /// Points field `name` `bytes` past its buffer's start.
    pub fn offset(&mut self, name: &str, bytes: usize) {
        // SAFETY: `slot` points into `self.args`; the pointer is only passed
        // to the library, which must refuse it.
        unsafe {
            let slot = self.args.slot(name);
            *slot = (*slot).wrapping_add(bytes);
        }
    }

    /// Points field `name` at `ptr` (until [`Call::restore`]).
    pub fn set(&mut self, name: &str, ptr: *mut u8) {
        // SAFETY: `slot` points into `self.args`.
        unsafe { *self.args.slot(name) = ptr };
    }

    fn add(&mut self, name: &'static str, buf: Box<dyn Buf>, output: bool) {
        self.set(name, buf.ptr());
        self.bufs.retain(|(n, _, _)| *n != name);
        self.bufs.push((name, buf, output));
    }

    /// Field `name` points to a copy of `data`.
    pub fn input<T: Copy>(&mut self, name: &'static str, data: &[T]) {
        let bytes = to_bytes(data);
        let buf = self.mem.alloc(bytes.len());
        buf.write(&bytes);
        self.add(name, buf, false);
    }

    /// Field `name` points to `bytes` of poison.
    pub fn output(&mut self, name: &'static str, bytes: usize) {
        let buf = self.mem.alloc(bytes);
        self.add(name, buf, true);
    }

    /// Field `name` points to `bytes` of poisoned host memory (`host_*`).
    pub fn host_output(&mut self, name: &'static str, bytes: usize) {
        let buf = HostMem.alloc(bytes);
        self.add(name, buf, true);
    }

    /// Whether field `name` points to a buffer now.
    pub fn is_set(&mut self, name: &str) -> bool {
        // SAFETY: `slot` points into `self.args`.
        !unsafe { *self.args.slot(name) }.is_null()
    }

    pub fn null(&mut self, name: &str) {
        self.set(name, null_mut());
    }

    /// Returns to the saved arguments (if any) and points every field back
    /// to its buffer.
    pub fn restore(&mut self) {
        if let Some(saved) = self.saved {
            self.args = saved;
        }
        let ptrs: Vec<(&str, *mut u8)> = self.bufs.iter().map(|(n, b, _)| (*n, b.ptr())).collect();
        for (name, ptr) in ptrs {
            self.set(name, ptr);
        }
    }

    pub fn poison(&self) {
        for (_, buf, output) in &self.bufs {
            if *output {
                buf.poison();
            }
        }
    }

    /// Whether every output is still all poison.
    pub fn untouched(&self) -> bool {
        self.bufs
            .iter()
            .filter(|(_, _, output)| *output)
            .all(|(_, buf, _)| buf.read().iter().all(|&b| b == POISON))
    }

    /// The buffer of field `name`.
    pub fn buf(&self, name: &str) -> &dyn Buf {
        let found = self.bufs.iter().find(|(n, _, _)| *n == name);
        found
            .unwrap_or_else(|| panic!("no buffer `{name}`"))
            .1
            .as_ref()
    }

    /// Checks that output `name`'s buffer (if it has one) is all poison.
    pub fn expect_untouched(&self, name: &str) -> Result<(), String> {
        match self.bufs.iter().find(|(n, _, _)| *n == name) {
            Some((_, buf, _)) if buf.read().iter().any(|&b| b != POISON) => {
                Err(format!("`{name}` was written though it is not in use"))
            }
            _ => Ok(()),
        }
    }

    /// Checks output `name`: where it is passed, its first bytes are `want`;
    /// where it is NULL, its buffer is untouched.
    pub fn expect(&mut self, name: &str, want: &[u8]) -> Result<(), String> {
        self.expect_rows(name, want, &[(0, want.len())])
    }

    /// Like [`Call::expect`], comparing only the byte ranges `(start, len)`.
    pub fn expect_rows(
        &mut self,
        name: &str,
        want: &[u8],
        ranges: &[(usize, usize)],
    ) -> Result<(), String> {
        if !self.bufs.iter().any(|(n, _, _)| *n == name) {
            return Ok(());
        }
        let got = self.buf(name).read();
        if !self.is_set(name) {
            return if got.iter().all(|&b| b == POISON) {
                Ok(())
            } else {
                Err(format!("`{name}` was NULL but its buffer changed"))
            };
        }
        for &(start, len) in ranges {
            if got[start..start + len] != want[start..start + len] {
                let at = (start..start + len)
                    .find(|&i| got[i] != want[i])
                    .unwrap_or(start);
                return Err(format!(
                    "`{name}` differs from the reference at byte {at} (got {:#04x}, want {:#04x})",
                    got[at], want[at]
                ));
            }
        }
        Ok(())
    }
}

/// The shape of a group and its config.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub world: usize,
    pub hidden: usize,
    pub topk: usize,
    pub experts: usize,
    pub max_tokens: usize,
    pub ll_max: usize,
}

impl Shape {
    pub fn topo(&self) -> Topology {
        Topology {
            world: self.world,
            num_experts: self.experts,
            topk: self.topk,
            hidden: self.hidden,
        }
    }

    pub fn local(&self) -> usize {
        self.experts / self.world
    }

    /// A host-backend config of this shape.
    pub fn config(&self) -> ep_config_t {
        super::host_config(
            self.hidden as i32,
            self.topk as i32,
            self.experts as i32,
            self.max_tokens as i32,
            self.ll_max as i32,
        )
    }
}

/// Routing and weights of `count` tokens: 15% of the slots dropped, the
/// first slot mostly to `hot` when given.
fn routed(rng: &mut Rng, shape: &Shape, count: usize, hot: Option<usize>) -> (Vec<i32>, Vec<f32>) {
    let idx = routing(rng, shape.experts, shape.topk, count, 0.15, hot);
    (idx, weights(rng, count * shape.topk))
}

/// Token inputs of every rank for one normal-mode dispatch.
pub struct Tokens {
    pub n: Vec<usize>,
    pub fp8: bool,
    pub x: Vec<Vec<u8>>,
    pub scales: Vec<Vec<f32>>,
    pub idx: Vec<Vec<i32>>,
    pub w: Vec<Vec<f32>>,
}

impl Tokens {
    pub fn new(shape: &Shape, seed: u64, n: &[usize], fp8: bool) -> Tokens {
        let mut t = Tokens {
            n: n.to_vec(),
            fp8,
            x: vec![],
            scales: vec![],
            idx: vec![],
            w: vec![],
        };
        let h = shape.hidden;
        for (rank, &count) in n.iter().enumerate() {
            let mut rng = Rng::new(seed.wrapping_mul(1_000_003).wrapping_add(rank as u64));
            let (idx, w) = routed(&mut rng, shape, count, seed.is_multiple_of(3).then_some(0));
            t.idx.push(idx);
            t.w.push(w);
            let values = random_bf16(&mut rng, count * h);
            if fp8 {
                let (x, s) = quantize_rows(&values, h);
                t.x.push(x);
                t.scales.push(s);
            } else {
                t.x.push(to_bytes(&values));
                t.scales.push(vec![]);
            }
        }
        t
    }

    pub fn dtype(&self) -> Dtype {
        dtype_of(self.fp8)
    }

    /// The reference dispatch as `rank` receives it.
    pub fn dispatched(&self, shape: &Shape, rank: usize, alignment: usize) -> Dispatched {
        let sources: Vec<RankTokens> = (0..shape.world)
            .map(|r| RankTokens {
                num_tokens: self.n[r],
                x: &self.x[r],
                scales: &self.scales[r],
                topk_idx: &self.idx[r],
                topk_weights: &self.w[r],
            })
            .collect();
        normal::dispatch(shape.topo(), self.dtype(), &sources, rank, alignment)
    }
}

/// Which outputs and flags a normal-mode dispatch uses.
#[derive(Clone, Copy, Debug)]
pub struct DispatchCase {
    pub source_order: bool,
    pub expert_major: bool,
    pub alignment: usize,
    pub no_host_sync: bool,
}

/// A normal-mode dispatch of `rank` and its reference.
pub struct DispatchCall<'m> {
    pub call: Call<'m, ep_dispatch_args_t>,
    pub want: Dispatched,
    pub case: DispatchCase,
}

impl<'m> DispatchCall<'m> {
    pub fn new(
        mem: &'m dyn Mem,
        shape: &Shape,
        tokens: &Tokens,
        rank: usize,
        case: DispatchCase,
    ) -> DispatchCall<'m> {
        let (h, k, l) = (shape.hidden, shape.topk, shape.local());
        let dtype = tokens.dtype();
        let (row, cols) = (dtype.row_bytes(h), dtype.scales_per_row(h));
        let mut a = super::dispatch_args();
        a.num_tokens = tokens.n[rank] as i32;
        a.dtype = dtype_code(dtype);
        a.flags = if case.no_host_sync {
            EP_DISPATCH_NO_HOST_SYNC
        } else {
            0
        };
        a.expert_alignment = case.alignment as i32;
        let (recv_cap, expert_cap) =
            normal::worst_case_rows(shape.topo(), shape.max_tokens, case.alignment);
        let mut call = Call::new(mem, a);
        call.input("x", &tokens.x[rank]);
        if tokens.fp8 {
            call.input("x_scales", &tokens.scales[rank]);
        }
        call.input("topk_idx", &tokens.idx[rank]);
        call.input("topk_weights", &tokens.w[rank]);
        if case.source_order {
            call.args.recv_capacity = recv_cap as i32;
            call.output("recv_x", recv_cap * row);
            if tokens.fp8 {
                call.output("recv_x_scales", recv_cap * cols * 4);
            }
            call.output("recv_topk_idx", recv_cap * k * 4);
            call.output("recv_topk_weights", recv_cap * k * 4);
            call.output("recv_src_info", recv_cap * 2 * 4);
            call.output("recv_num_tokens", 4);
        }
        if case.expert_major {
            call.args.expert_capacity = expert_cap as i32;
            call.output("expert_x", expert_cap * row);
            if tokens.fp8 {
                call.output("expert_x_scales", expert_cap * cols * 4);
            }
            call.output("expert_weights", expert_cap * 4);
            call.output("expert_src_row", expert_cap * 4);
            call.output("expert_offsets", (l + 1) * 4);
            call.output("expert_counts", l * 4);
        }
        call.host_output("host_recv_num_tokens", 4);
        call.host_output("host_expert_counts", l * 4);
        DispatchCall {
            call,
            want: tokens.dispatched(shape, rank, case.alignment),
            case,
        }
    }

    pub fn run(&mut self, ctx: &Ctx, handle: *mut ep_handle_t) -> ep_status_t {
        // SAFETY: live context and handle; buffers sized as the API says.
        unsafe { ep_dispatch(ctx.0, &self.call.args, handle, self.call.stream()) }
    }

    /// Compares every output passed with the reference. Without its rows,
    /// an output's other arrays must be left alone.
    pub fn check(&mut self) -> Result<(), String> {
        check_dispatched(&mut self.call, &self.want, self.case.no_host_sync)
    }
}

/// Compares every dispatch output `c` passes with the reference `d`
/// (`no_host_sync`: the `host_*` outputs are not written).
pub fn check_dispatched<A: PointerFields>(
    c: &mut Call<'_, A>,
    d: &Dispatched,
    no_host_sync: bool,
) -> Result<(), String> {
    let rows = d.num_rows as i32;
    if c.is_set("recv_x") {
        c.expect("recv_x", &d.x)?;
        c.expect("recv_x_scales", &to_bytes(&d.scales))?;
        c.expect("recv_topk_idx", &to_bytes(&d.topk_idx))?;
        c.expect("recv_topk_weights", &to_bytes(&bits(&d.topk_weights)))?;
        c.expect("recv_src_info", &to_bytes(&d.src_info))?;
        c.expect("recv_num_tokens", &to_bytes(&[rows]))?;
    } else {
        for name in RECV_FIELDS {
            c.expect_untouched(name)?;
        }
    }
    if c.is_set("expert_x") {
        c.expect("expert_x", &d.expert_x)?;
        c.expect("expert_x_scales", &to_bytes(&d.expert_scales))?;
        c.expect("expert_weights", &to_bytes(&bits(&d.expert_weights)))?;
        c.expect("expert_src_row", &to_bytes(&d.expert_src_row))?;
        c.expect("expert_offsets", &to_bytes(&d.expert_offsets))?;
        c.expect("expert_counts", &to_bytes(&d.expert_counts))?;
    } else {
        for name in EXPERT_FIELDS {
            c.expect_untouched(name)?;
        }
    }
    if !no_host_sync {
        c.expect("host_recv_num_tokens", &to_bytes(&[rows]))?;
        c.expect("host_expert_counts", &to_bytes(&d.expert_counts))?;
    }
    Ok(())
}

/// The source-order and expert-major arrays besides the rows.
const RECV_FIELDS: [&str; 5] = [
    "recv_x_scales",
    "recv_topk_idx",
    "recv_topk_weights",
    "recv_src_info",
    "recv_num_tokens",
];
const EXPERT_FIELDS: [&str; 5] = [
    "expert_x_scales",
    "expert_weights",
    "expert_src_row",
    "expert_offsets",
    "expert_counts",
];

/// The rows each rank gives `ep_combine`: random BF16, one row per received
/// row of the layout (from the seed, so every rank knows every rank's).
pub fn combine_rows(shape: &Shape, seed: u64, rows: usize, rank: usize) -> Vec<bf16> {
    let mut rng = Rng::new(seed ^ 0xc0b1_7e00 ^ (rank as u64) << 32);
    random_bf16(&mut rng, rows * shape.hidden)
}

/// The reference of `ep_combine` on `rank`, every rank having dispatched
/// `dispatched[r]` and given `rows[r]` in the layout of `expert_major`.
pub fn combine_reference(
    topo: Topology,
    rank: usize,
    num_tokens: usize,
    dispatched: &[Dispatched],
    rows: &[Vec<bf16>],
    expert_major: bool,
) -> Vec<bf16> {
    let partials: Vec<Vec<bf16>> = (0..topo.world)
        .map(|r| {
            if expert_major {
                normal::expert_partials(topo, &dispatched[r], &rows[r])
            } else {
                rows[r].clone()
            }
        })
        .collect();
    let returned: Vec<Returned> = (0..topo.world)
        .map(|r| Returned {
            rows: &partials[r],
            src_info: &dispatched[r].src_info,
        })
        .collect();
    normal::combine(topo, rank, num_tokens, &returned)
}

/// Compares a BF16 output with the reference, within `tolerance` relative
/// to the reference's magnitude (0: bit-exact).
pub fn compare_bf16(name: &str, got: &[bf16], want: &[bf16], tolerance: f32) -> Result<(), String> {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if tolerance == 0.0 {
            g.to_bits() == w.to_bits()
        } else {
            (g.to_f32() - w.to_f32()).abs() <= tolerance * w.to_f32().abs().max(1.0)
        };
        if !ok {
            return Err(format!("`{name}`[{i}] = {g}, reference {w}"));
        }
    }
    Ok(())
}

/// A normal-mode combine of `rank`, and its reference.
pub struct CombineCall<'m> {
    pub call: Call<'m, ep_combine_args_t>,
    pub want: Vec<bf16>,
}

impl<'m> CombineCall<'m> {
    pub fn new(
        mem: &'m dyn Mem,
        shape: &Shape,
        rank: usize,
        num_tokens: usize,
        dispatched: &[Dispatched],
        seed: u64,
        expert_major: bool,
    ) -> CombineCall<'m> {
        let rows: Vec<Vec<bf16>> = (0..shape.world)
            .map(|r| {
                let d = &dispatched[r];
                let n = if expert_major {
                    d.expert_rows
                } else {
                    d.num_rows
                };
                combine_rows(shape, seed, n, r)
            })
            .collect();
        let mut a = super::combine_args();
        a.input_layout = if expert_major {
            EP_COMBINE_EXPERT_MAJOR
        } else {
            EP_COMBINE_SOURCE_ORDER
        };
        let mut call = Call::new(mem, a);
        call.input("x", &rows[rank]);
        call.output("out", num_tokens * shape.hidden * 2);
        CombineCall {
            call,
            want: combine_reference(
                shape.topo(),
                rank,
                num_tokens,
                dispatched,
                &rows,
                expert_major,
            ),
        }
    }

    pub fn run(&mut self, ctx: &Ctx, handle: *mut ep_handle_t) -> ep_status_t {
        // SAFETY: live context and handle; buffers sized as the API says.
        unsafe { ep_combine(ctx.0, &self.call.args, handle, self.call.stream()) }
    }

    pub fn check(&mut self, tolerance: f32) -> Result<(), String> {
        if !self.call.is_set("out") {
            return self.call.expect("out", &[]);
        }
        let got: Vec<bf16> = from_bytes(&self.call.buf("out").read());
        compare_bf16("out", &got, &self.want, tolerance)
    }
}

/// A layout call of `rank` and its reference.
pub struct LayoutCall<'m> {
    pub call: Call<'m, LayoutArgs>,
    want: ep::reference::layout::Layout,
}

impl<'m> LayoutCall<'m> {
    pub fn new(mem: &'m dyn Mem, shape: &Shape, idx: &[i32], n: usize) -> LayoutCall<'m> {
        let args = LayoutArgs {
            num_tokens: n as i32,
            topk_idx: std::ptr::null(),
            num_tokens_per_rank: null_mut(),
            num_tokens_per_expert: null_mut(),
            is_token_in_rank: null_mut(),
        };
        let mut call = Call::new(mem, args);
        call.input("topk_idx", idx);
        call.output("num_tokens_per_rank", shape.world * 4);
        call.output("num_tokens_per_expert", shape.experts * 4);
        call.output("is_token_in_rank", n * shape.world);
        LayoutCall {
            call,
            want: dispatch_layout(shape.topo(), idx, n).expect("valid routing"),
        }
    }

    pub fn run(&self, ctx: &Ctx) -> ep_status_t {
        self.run_on(ctx, self.call.stream())
    }

    /// [`LayoutCall::run`] on `stream`.
    pub fn run_on(&self, ctx: &Ctx, stream: ep_stream_t) -> ep_status_t {
        let a = &self.call.args;
        // SAFETY: live context; buffers sized as the API says.
        unsafe {
            ep_get_dispatch_layout(
                ctx.0,
                a.topk_idx,
                a.num_tokens,
                a.num_tokens_per_rank,
                a.num_tokens_per_expert,
                a.is_token_in_rank,
                stream,
            )
        }
    }

    pub fn check(&mut self) -> Result<(), String> {
        let w = &self.want;
        self.call
            .expect("num_tokens_per_rank", &to_bytes(&w.tokens_per_rank))?;
        self.call
            .expect("num_tokens_per_expert", &to_bytes(&w.tokens_per_expert))?;
        self.call.expect("is_token_in_rank", &w.is_token_in_rank)
    }
}

/// Low-latency inputs of every rank.
pub struct LlTokens {
    pub n: Vec<usize>,
    pub x: Vec<Vec<bf16>>,
    pub idx: Vec<Vec<i32>>,
    pub w: Vec<Vec<f32>>,
}

impl LlTokens {
    pub fn new(shape: &Shape, seed: u64, n: &[usize]) -> LlTokens {
        let mut t = LlTokens {
            n: n.to_vec(),
            x: vec![],
            idx: vec![],
            w: vec![],
        };
        for (rank, &count) in n.iter().enumerate() {
            let mut rng = Rng::new(seed.wrapping_mul(31).wrapping_add(rank as u64));
            let hot = seed.is_multiple_of(2).then_some(shape.experts - 1);
            let (idx, w) = routed(&mut rng, shape, count, hot);
            t.idx.push(idx);
            t.w.push(w);
            t.x.push(random_bf16(&mut rng, count * shape.hidden));
        }
        t
    }

    /// Every rank's tokens as the reference takes them, with the weights
    /// when `weights`.
    pub fn sources(&self, weights: bool) -> Vec<LlRankTokens<'_>> {
        (0..self.n.len())
            .map(|r| LlRankTokens {
                num_tokens: self.n[r],
                x: &self.x[r],
                topk_idx: &self.idx[r],
                topk_weights: weights.then_some(&self.w[r][..]),
            })
            .collect()
    }

    /// The reference dispatch as `rank` receives it.
    pub fn dispatched(&self, shape: &Shape, rank: usize, case: &LlDispatchCase) -> LlDispatched {
        ll_dispatch(
            shape.topo(),
            shape.ll_max,
            &self.sources(case.weights),
            rank,
            dtype_of(case.fp8),
            case.ue8m0,
        )
    }
}

/// Flags and optional inputs of a low-latency dispatch.
#[derive(Clone, Copy, Debug)]
pub struct LlDispatchCase {
    pub fp8: bool,
    pub ue8m0: bool,
    pub weights: bool,
    /// Two calls, `EP_LL_SEND_ONLY` then `EP_LL_RECV_ONLY`.
    pub split: bool,
    /// The token count is also given in memory (`device_num_tokens`).
    pub device_count: bool,
}

/// The flags of each call a split or whole low-latency call makes.
pub fn ll_phases(split: bool) -> Vec<u32> {
    if split {
        vec![EP_LL_SEND_ONLY, EP_LL_RECV_ONLY]
    } else {
        vec![0]
    }
}

/// Runs each half of a (split or whole) call until one fails.
fn run_halves(split: bool, mut run: impl FnMut(usize) -> ep_status_t) -> ep_status_t {
    (0..ll_phases(split).len())
        .map(&mut run)
        .find(|&status| status != EP_SUCCESS)
        .unwrap_or(EP_SUCCESS)
}

/// A low-latency dispatch of `rank` and its reference.
pub struct LlDispatchCall<'m> {
    pub call: Call<'m, ep_ll_dispatch_args_t>,
    pub want: LlDispatched,
    pub case: LlDispatchCase,
    shape: Shape,
}

impl<'m> LlDispatchCall<'m> {
    pub fn new(
        mem: &'m dyn Mem,
        shape: &Shape,
        tokens: &LlTokens,
        rank: usize,
        case: LlDispatchCase,
    ) -> LlDispatchCall<'m> {
        let (h, l, slots) = (
            shape.hidden,
            shape.local(),
            shape.local() * shape.world * shape.ll_max,
        );
        let mut a = super::ll_dispatch_args();
        a.num_tokens = tokens.n[rank] as i32;
        let dtype = dtype_of(case.fp8);
        a.out_dtype = dtype_code(dtype);
        let mut call = Call::new(mem, a);
        call.input("x", &tokens.x[rank]);
        call.input("topk_idx", &tokens.idx[rank]);
        if case.weights {
            call.input("topk_weights", &tokens.w[rank]);
        }
        if case.device_count {
            call.input("device_num_tokens", &[tokens.n[rank] as i32]);
        }
        call.output("recv_x", slots * dtype.row_bytes(h));
        if case.fp8 {
            call.output("recv_x_scales", slots * h / 128 * 4);
        }
        call.output("recv_count", l * 4);
        call.output("recv_src_info", slots * 4);
        call.output("recv_layout_range", l * shape.world * 2 * 4);
        LlDispatchCall {
            call,
            want: tokens.dispatched(shape, rank, &case),
            case,
            shape: *shape,
        }
    }

    /// Runs half `phase` of [`ll_phases`].
    pub fn run(&mut self, ctx: &Ctx, phase: usize) -> ep_status_t {
        let mut a = self.call.args;
        a.flags |= ll_phases(self.case.split)[phase] | self.ue8m0_flag();
        // SAFETY: live context; buffers sized as the API says.
        unsafe { ep_ll_dispatch(ctx.0, &a, self.call.stream()) }
    }

    fn ue8m0_flag(&self) -> u32 {
        if self.case.ue8m0 {
            EP_LL_UE8M0_SCALES
        } else {
            0
        }
    }

    /// Runs every half.
    pub fn run_all(&mut self, ctx: &Ctx) -> ep_status_t {
        run_halves(self.case.split, |phase| self.run(ctx, phase))
    }

    /// Compares the valid rows of every output passed with the reference.
    pub fn check(&mut self) -> Result<(), String> {
        let (s, d) = (&self.shape, &self.want);
        let block = s.world * s.ll_max;
        let dtype = dtype_of(self.case.fp8);
        let valid = |unit: usize| -> Vec<(usize, usize)> {
            (0..s.local())
                .map(|le| (le * block * unit, d.recv_count[le] as usize * unit))
                .collect()
        };
        let c = &mut self.call;
        c.expect_rows("recv_x", &d.recv_x, &valid(dtype.row_bytes(s.hidden)))?;
        c.expect_rows(
            "recv_x_scales",
            &to_bytes(&d.recv_scales),
            &valid(dtype.scales_per_row(s.hidden) * 4),
        )?;
        c.expect("recv_count", &to_bytes(&d.recv_count))?;
        c.expect_rows("recv_src_info", &to_bytes(&d.recv_src_info), &valid(4))?;
        c.expect("recv_layout_range", &to_bytes(&d.recv_layout_range))
    }
}

/// How a low-latency combine is called.
#[derive(Clone, Copy, Debug)]
pub struct LlCombineCase {
    /// Weights passed to the combine (else NULL: the dispatch's apply).
    pub weights: bool,
    pub zero_copy: bool,
    pub split: bool,
    pub device_count: bool,
}

/// The expert outputs each rank gives `ep_ll_combine`, in its masked layout.
pub fn ll_expert_outputs(shape: &Shape, seed: u64, rank: usize) -> Vec<bf16> {
    let slots = shape.local() * shape.world * shape.ll_max;
    let mut rng = Rng::new(seed ^ 0x11c0_b17e ^ (rank as u64) << 40);
    random_bf16(&mut rng, slots * shape.hidden)
}

/// A low-latency combine of `rank`, after every rank's dispatch of
/// `tokens` (whose references are `dispatched`), and its references.
pub struct LlCombineCall<'m> {
    pub call: Call<'m, ep_ll_combine_args_t>,
    pub case: LlCombineCase,
    y: Vec<bf16>,
    /// The reference with the combine's weights, and with the dispatch's
    /// (when it had them).
    want_weighted: Vec<bf16>,
    want_pre_weighted: Option<Vec<bf16>>,
}

impl<'m> LlCombineCall<'m> {
    pub fn new(
        mem: &'m dyn Mem,
        shape: &Shape,
        tokens: &LlTokens,
        dispatched: &[LlDispatched],
        rank: usize,
        seed: u64,
        case: LlCombineCase,
    ) -> LlCombineCall<'m> {
        let ys: Vec<Vec<bf16>> = (0..shape.world)
            .map(|r| ll_expert_outputs(shape, seed, r))
            .collect();
        let experts: Vec<LlExpertOutputs> = (0..shape.world)
            .map(|r| LlExpertOutputs {
                y: &ys[r],
                src_info: &dispatched[r].recv_src_info,
                layout_range: &dispatched[r].recv_layout_range,
                weights: dispatched[r].recv_weights.as_deref(),
            })
            .collect();
        let (n, idx) = (tokens.n[rank], &tokens.idx[rank]);
        let reference =
            |w: Option<&[f32]>| ll_combine(shape.topo(), shape.ll_max, rank, n, idx, w, &experts);
        let want_weighted = reference(Some(&tokens.w[rank]));
        let want_pre_weighted = experts
            .iter()
            .all(|e| e.weights.is_some())
            .then(|| reference(None));
        let mut a = super::ll_combine_args();
        a.num_tokens = n as i32;
        let mut call = Call::new(mem, a);
        call.input("x", &ys[rank]);
        call.input("topk_idx", idx);
        if case.weights {
            call.input("topk_weights", &tokens.w[rank]);
        }
        call.input("src_info", &dispatched[rank].recv_src_info);
        call.input("layout_range", &dispatched[rank].recv_layout_range);
        if case.device_count {
            call.input("device_num_tokens", &[n as i32]);
        }
        call.output("out", n * shape.hidden * 2);
        LlCombineCall {
            call,
            case,
            y: ys[rank].clone(),
            want_weighted,
            want_pre_weighted,
        }
    }

    /// With `EP_LL_ZERO_COPY`: writes this rank's expert outputs into the
    /// context's combine buffer (after the dispatch, before the combine).
    pub fn fill_combine_buffer(&self, ctx: &Ctx, mem: &dyn Mem) {
        if !self.case.zero_copy {
            return;
        }
        let mut buf = null_mut();
        // SAFETY: live context, valid out-parameter.
        let status = unsafe { ep_ll_get_combine_buffer(ctx.0, &mut buf, null_mut()) };
        assert_eq!(status, EP_SUCCESS, "{}", super::last_error());
        mem.write_at(buf as *mut u8, &to_bytes(&self.y));
    }

    /// Runs half `phase` of [`ll_phases`].
    pub fn run(&mut self, ctx: &Ctx, phase: usize) -> ep_status_t {
        let mut a = self.call.args;
        a.flags |= ll_phases(self.case.split)[phase]
            | if self.case.zero_copy {
                EP_LL_ZERO_COPY
            } else {
                0
            };
        // SAFETY: live context; buffers sized as the API says.
        unsafe { ep_ll_combine(ctx.0, &a, self.call.stream()) }
    }

    /// Runs every half.
    pub fn run_all(&mut self, ctx: &Ctx) -> ep_status_t {
        run_halves(self.case.split, |phase| self.run(ctx, phase))
    }

    pub fn check(&mut self, tolerance: f32) -> Result<(), String> {
        if !self.call.is_set("out") {
            return self.call.expect("out", &[]);
        }
        let want = if self.call.is_set("topk_weights") {
            &self.want_weighted
        } else {
            self.want_pre_weighted
                .as_ref()
                .ok_or("combine without weights after a dispatch without weights succeeded")?
        };
        let got: Vec<bf16> = from_bytes(&self.call.buf("out").read());
        compare_bf16("out", &got[..want.len()], want, tolerance)
    }
}
