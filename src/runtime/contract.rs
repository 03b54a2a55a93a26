//! The pointer contract: for every pointer argument of every operation,
//! when it may be NULL, what NULL then means, and what memory it must be.
//!
//! One table per operation ([`LAYOUT`], [`DISPATCH`], [`COMBINE`],
//! [`LL_DISPATCH`], [`LL_COMBINE`], [`MEGA`], [`MOE`]) lists its pointers with their
//! rule. The runtime validates every call against its table before anything
//! is communicated or enqueued ([`check_pointers`]), the header's doc of each
//! field contains [`Field::doc`] word for word, and the contract tests walk
//! the same tables, so the three cannot drift apart.
//!
//! A required pointer that is NULL is `EP_ERR_NULL_POINTER`, naming the
//! field and its rule. Every non-NULL pointer that the call uses must be
//! aligned to its element size (both backends), and must be memory the
//! backend can use ([`crate::runtime::backend::Backend::check_pointer`]: on
//! the GPU backend, device memory of the context's device).

use super::ops::{CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp, MegaOp, MoeExperts};
use crate::error::{Error, Result};
use std::os::raw::c_void;
use std::ptr::null;

/// A condition under which a pointer is required.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cond {
    /// The call has tokens: `num_tokens > 0` (for a combine: the tokens of
    /// the dispatch it combines).
    Tokens,
    /// The normal-mode dispatch moves FP8 tokens (`dtype`).
    Fp8,
    /// The low-latency dispatch writes FP8 rows (`out_dtype`).
    Fp8Out,
    /// The source-order output is requested (`recv_x` is given).
    SourceOrder,
    /// `recv_x` is NULL.
    NoSourceOrder,
    /// The expert-major output is requested (`expert_x` is given).
    ExpertMajor,
    /// `expert_x` is NULL.
    NoExpertMajor,
    /// The combine's input rows may be non-empty: the handle's dispatch
    /// received rows for this layout, or did not tell the host how many.
    Rows,
    /// The call runs its send phase (`EP_LL_RECV_ONLY` not set).
    Send,
    /// The call runs its receive phase (`EP_LL_SEND_ONLY` not set).
    Recv,
    /// `EP_LL_ZERO_COPY` is not set.
    Copy,
    /// The low-latency dispatch this combine pairs with had no weights.
    Unweighted,
    /// A fused call's GEMM is FP8 (`weight_dtype`).
    Fp8Weights,
    /// The fused call is `ep_mega_dispatch_gemm`.
    FusedDispatch,
    /// The fused call is `ep_mega_gemm_combine`.
    FusedCombine,
}

impl Cond {
    /// The condition as the header states it.
    pub fn phrase(self) -> &'static str {
        match self {
            Cond::Tokens => "num_tokens > 0",
            Cond::Fp8 => "dtype is FP8",
            Cond::Fp8Out => "out_dtype is FP8",
            Cond::SourceOrder => "`recv_x` is given",
            Cond::NoSourceOrder => "`recv_x` is NULL",
            Cond::ExpertMajor => "`expert_x` is given",
            Cond::NoExpertMajor => "`expert_x` is NULL",
            Cond::Rows => {
                "the handle's dispatch received rows for this layout or ran with EP_DISPATCH_NO_HOST_SYNC"
            }
            Cond::Send => "the send phase runs (no EP_LL_RECV_ONLY)",
            Cond::Recv => "the receive phase runs (no EP_LL_SEND_ONLY)",
            Cond::Copy => "EP_LL_ZERO_COPY is not set",
            Cond::Unweighted => "the matching ep_ll_dispatch was given no topk_weights",
            Cond::Fp8Weights => "weight_dtype is FP8",
            Cond::FusedDispatch => "the call is ep_mega_dispatch_gemm",
            Cond::FusedCombine => "the call is ep_mega_gemm_combine",
        }
    }

    pub fn holds(self, f: &Facts) -> bool {
        match self {
            Cond::Tokens => f.tokens,
            Cond::Fp8 | Cond::Fp8Out | Cond::Fp8Weights => f.fp8,
            Cond::SourceOrder => f.source_order,
            Cond::NoSourceOrder => !f.source_order,
            Cond::ExpertMajor => f.expert_major,
            Cond::NoExpertMajor => !f.expert_major,
            Cond::Rows => f.rows,
            Cond::Send => f.send,
            Cond::Recv => f.recv,
            Cond::Copy => !f.zero_copy,
            Cond::Unweighted => f.unweighted,
            Cond::FusedDispatch => !f.fused_combine,
            Cond::FusedCombine => f.fused_combine,
        }
    }
}

/// What one call is, as far as the pointer rules care. Each operation
/// derives its facts from its arguments (and the context's state).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Facts {
    pub tokens: bool,
    pub fp8: bool,
    pub source_order: bool,
    pub expert_major: bool,
    pub rows: bool,
    pub send: bool,
    pub recv: bool,
    pub zero_copy: bool,
    pub unweighted: bool,
    pub fused_combine: bool,
}

/// When a pointer must be given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Never NULL.
    Always,
    /// Required when every condition holds; otherwise it is not used and may
    /// be NULL.
    When(&'static [Cond]),
    /// Required when every condition holds; otherwise it may be NULL, and
    /// when given the call still reads or writes it (an output that is
    /// optional once another output is requested, say).
    WhenElseOptional(&'static [Cond]),
    /// May be NULL; when given, the call reads or writes it.
    Optional,
    /// Never read or written (kept for compatibility); may be NULL.
    Unused,
}

/// Where a pointer's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Device memory of the context's GPU on the GPU backend; host memory on
    /// the host backend.
    Device,
    /// Host memory on both backends (the `host_*` outputs).
    Host,
}

/// One pointer argument of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// Its C name, as in the header and in error messages.
    pub name: &'static str,
    pub need: Need,
    /// What the call does instead when the pointer is NULL and may be.
    pub if_null: &'static str,
    pub memory: Memory,
    /// Bytes of one element: the pointer must be aligned to it.
    pub elem: usize,
    /// An array of token rows (the GPU backend moves rows as 16-byte vectors).
    pub rows: bool,
}

impl Field {
    /// Whether the call needs this pointer.
    pub fn required(&self, facts: &Facts) -> bool {
        match self.need {
            Need::Always => true,
            Need::When(conds) | Need::WhenElseOptional(conds) => {
                conds.iter().all(|c| c.holds(facts))
            }
            Need::Optional | Need::Unused => false,
        }
    }

    /// Whether the call reads or writes this pointer when it is given.
    pub fn used(&self, facts: &Facts) -> bool {
        match self.need {
            Need::Always | Need::Optional | Need::WhenElseOptional(_) => true,
            Need::When(_) => self.required(facts),
            Need::Unused => false,
        }
    }

    /// The rule as the header states it (each field's doc contains it).
    pub fn doc(&self) -> String {
        match self.need {
            Need::Always => "Required.".to_string(),
            Need::When(conds) | Need::WhenElseOptional(conds) => {
                let when: Vec<&str> = conds.iter().map(|c| c.phrase()).collect();
                format!(
                    "Required when {}; may be NULL otherwise (then {}).",
                    when.join(" and "),
                    self.if_null
                )
            }
            Need::Optional => format!("May be NULL (then {}).", self.if_null),
            Need::Unused => format!("Not used; may be NULL ({}).", self.if_null),
        }
    }

    fn null_error(&self) -> Error {
        let why = match self.need {
            Need::When(conds) | Need::WhenElseOptional(conds) => {
                let when: Vec<&str> = conds.iter().map(|c| c.phrase()).collect();
                format!(" (required when {})", when.join(" and "))
            }
            _ => " (required)".to_string(),
        };
        Error::new(
            crate::error::ErrorKind::NullPointer,
            format!("`{}` is NULL{why}", self.name),
        )
    }
}

/// A field of an operation's table with the accessor of its value.
pub struct Pointer<Op> {
    pub field: Field,
    pub get: fn(&Op) -> *const c_void,
}

/// The fields of a table, without their accessors (for tests and docs).
pub fn fields<Op>(table: &[Pointer<Op>]) -> impl Iterator<Item = &Field> {
    table.iter().map(|p| &p.field)
}

/// What [`check_pointers`] asks of the backend for each pointer.
pub trait PointerCheck {
    /// `ptr` (not NULL, aligned) is memory the backend can use for `field`.
    fn check_pointer(&self, field: &Field, ptr: *const c_void) -> Result<()>;
}

/// Checks every pointer of `op` against its table: first that no required
/// one is NULL, then that every used one is aligned to its element and is
/// memory `backend` accepts.
pub fn check_pointers<Op>(
    table: &[Pointer<Op>],
    op: &Op,
    facts: &Facts,
    backend: &(impl PointerCheck + ?Sized),
) -> Result<()> {
    for p in table {
        if p.field.required(facts) && (p.get)(op).is_null() {
            return Err(p.field.null_error());
        }
    }
    for p in table {
        let ptr = (p.get)(op);
        if ptr.is_null() || !p.field.used(facts) {
            continue;
        }
        if !(ptr as usize).is_multiple_of(p.field.elem) {
            return Err(Error::invalid(format!(
                "`{}` = {ptr:p} is not {}-byte aligned",
                p.field.name, p.field.elem
            )));
        }
        backend.check_pointer(&p.field, ptr)?;
    }
    Ok(())
}

/// An error for a pointer that is not device memory of `device`, for the
/// GPU backend's [`PointerCheck`]: `what` says what it is instead (e.g.
/// "host memory", "device memory of device 1").
pub fn wrong_memory(field: &Field, ptr: *const c_void, what: &str, device: i32) -> Error {
    Error::invalid(format!(
        "`{}` = {ptr:p} is {what}, expected device memory of device {device}",
        field.name
    ))
}

const fn field(name: &'static str, need: Need, if_null: &'static str, elem: usize) -> Field {
    Field {
        name,
        need,
        if_null,
        memory: Memory::Device,
        elem,
        rows: false,
    }
}

const fn rows(name: &'static str, need: Need, if_null: &'static str, elem: usize) -> Field {
    Field {
        rows: true,
        ..field(name, need, if_null, elem)
    }
}

const fn host(name: &'static str, if_null: &'static str) -> Field {
    Field {
        memory: Memory::Host,
        ..field(name, Need::Optional, if_null, 4)
    }
}

fn cv<T>(p: *const T) -> *const c_void {
    p as *const c_void
}

const NOTHING_READ: &str = "nothing is read";
const NOT_WRITTEN: &str = "not written";
const TOKENS: Need = Need::When(&[Cond::Tokens]);

/// `ep_get_dispatch_layout`.
pub const LAYOUT: &[Pointer<LayoutOp>] = &[
    Pointer {
        field: field("topk_idx", TOKENS, NOTHING_READ, 4),
        get: |op| cv(op.topk_idx),
    },
    Pointer {
        field: field("num_tokens_per_rank", Need::Always, "", 4),
        get: |op| cv(op.tokens_per_rank),
    },
    Pointer {
        field: field("num_tokens_per_expert", Need::Always, "", 4),
        get: |op| cv(op.tokens_per_expert),
    },
    Pointer {
        field: field("is_token_in_rank", TOKENS, NOT_WRITTEN, 1),
        get: |op| cv(op.is_token_in_rank),
    },
];

fn recv_ptr<T>(
    op: &DispatchOp,
    get: impl Fn(&super::ops::SourceOrderOut) -> *const T,
) -> *const c_void {
    op.recv.as_ref().map_or(null(), |r| cv(get(r)))
}

fn expert_ptr<T>(
    op: &DispatchOp,
    get: impl Fn(&super::ops::ExpertMajorOut) -> *const T,
) -> *const c_void {
    op.expert.as_ref().map_or(null(), |e| cv(get(e)))
}

const EXPERT_MAJOR: Need = Need::When(&[Cond::ExpertMajor]);

/// `ep_dispatch` (and the dispatch half of `ep_mega_dispatch_gemm`).
pub const DISPATCH: &[Pointer<DispatchOp>] = &[
    Pointer {
        field: rows("x", TOKENS, NOTHING_READ, 1),
        get: |op| cv(op.x),
    },
    Pointer {
        field: field(
            "x_scales",
            Need::When(&[Cond::Fp8, Cond::Tokens]),
            NOTHING_READ,
            4,
        ),
        get: |op| cv(op.x_scales),
    },
    Pointer {
        field: field("topk_idx", TOKENS, NOTHING_READ, 4),
        get: |op| cv(op.topk_idx),
    },
    Pointer {
        field: field("topk_weights", TOKENS, NOTHING_READ, 4),
        get: |op| cv(op.topk_weights),
    },
    Pointer {
        field: rows(
            "recv_x",
            Need::WhenElseOptional(&[Cond::NoExpertMajor]),
            "no source-order output; the other recv_* pointers are not used",
            1,
        ),
        get: |op| recv_ptr(op, |r| r.x),
    },
    Pointer {
        field: field(
            "recv_x_scales",
            Need::When(&[Cond::SourceOrder, Cond::Fp8]),
            NOT_WRITTEN,
            4,
        ),
        get: |op| recv_ptr(op, |r| r.scales),
    },
    Pointer {
        field: field("recv_topk_idx", Need::Optional, NOT_WRITTEN, 4),
        get: |op| recv_ptr(op, |r| r.topk_idx),
    },
    Pointer {
        field: field("recv_topk_weights", Need::Optional, NOT_WRITTEN, 4),
        get: |op| recv_ptr(op, |r| r.topk_weights),
    },
    Pointer {
        field: field("recv_src_info", Need::Optional, NOT_WRITTEN, 4),
        get: |op| recv_ptr(op, |r| r.src_info),
    },
    Pointer {
        field: field("recv_num_tokens", Need::Optional, NOT_WRITTEN, 4),
        get: |op| recv_ptr(op, |r| r.num_rows),
    },
    Pointer {
        field: rows(
            "expert_x",
            Need::WhenElseOptional(&[Cond::NoSourceOrder]),
            "no expert-major output; the other expert_* pointers are not used",
            1,
        ),
        get: |op| expert_ptr(op, |e| e.x),
    },
    Pointer {
        field: field(
            "expert_x_scales",
            Need::When(&[Cond::ExpertMajor, Cond::Fp8]),
            NOT_WRITTEN,
            4,
        ),
        get: |op| expert_ptr(op, |e| e.scales),
    },
    Pointer {
        field: field("expert_weights", Need::Optional, NOT_WRITTEN, 4),
        get: |op| expert_ptr(op, |e| e.weights),
    },
    Pointer {
        field: field("expert_src_row", Need::Optional, NOT_WRITTEN, 4),
        get: |op| expert_ptr(op, |e| e.src_row),
    },
    Pointer {
        field: field("expert_offsets", EXPERT_MAJOR, NOT_WRITTEN, 4),
        get: |op| expert_ptr(op, |e| e.offsets),
    },
    Pointer {
        field: field("expert_counts", Need::Optional, NOT_WRITTEN, 4),
        get: |op| expert_ptr(op, |e| e.counts),
    },
    Pointer {
        field: host("host_recv_num_tokens", NOT_WRITTEN),
        get: |op| cv(op.host_recv_num_rows),
    },
    Pointer {
        field: host("host_expert_counts", NOT_WRITTEN),
        get: |op| cv(op.host_expert_counts),
    },
];

/// `ep_combine`. Its facts come from the handle's dispatch (see
/// [`Cond::Rows`] and [`Cond::Tokens`]).
pub const COMBINE: &[Pointer<CombineOp>] = &[
    Pointer {
        field: rows("x", Need::When(&[Cond::Rows]), NOTHING_READ, 2),
        get: |op| cv(op.x),
    },
    Pointer {
        field: rows("out", TOKENS, NOT_WRITTEN, 2),
        get: |op| cv(op.out),
    },
];

const SEND_TOKENS: Need = Need::When(&[Cond::Send, Cond::Tokens]);
const RECV: Need = Need::When(&[Cond::Recv]);
const DEVICE_COUNT: &str = "num_tokens is the token count";

/// `ep_ll_dispatch`.
pub const LL_DISPATCH: &[Pointer<LlDispatchOp>] = &[
    Pointer {
        field: rows("x", SEND_TOKENS, NOTHING_READ, 2),
        get: |op| cv(op.x),
    },
    Pointer {
        field: field("topk_idx", SEND_TOKENS, NOTHING_READ, 4),
        get: |op| cv(op.topk_idx),
    },
    Pointer {
        field: field(
            "topk_weights",
            Need::Optional,
            "the matching ep_ll_combine must be given topk_weights",
            4,
        ),
        get: |op| cv(op.topk_weights),
    },
    Pointer {
        field: rows("recv_x", RECV, NOT_WRITTEN, 1),
        get: |op| cv(op.recv_x),
    },
    Pointer {
        field: field(
            "recv_x_scales",
            Need::When(&[Cond::Recv, Cond::Fp8Out]),
            NOT_WRITTEN,
            4,
        ),
        get: |op| cv(op.recv_scales),
    },
    Pointer {
        field: field("recv_count", RECV, NOT_WRITTEN, 4),
        get: |op| cv(op.recv_count),
    },
    Pointer {
        field: field("recv_src_info", Need::Optional, NOT_WRITTEN, 4),
        get: |op| cv(op.recv_src_info),
    },
    Pointer {
        field: field("recv_layout_range", Need::Optional, NOT_WRITTEN, 4),
        get: |op| cv(op.recv_layout_range),
    },
    Pointer {
        field: field("device_num_tokens", Need::Optional, DEVICE_COUNT, 4),
        get: |op| cv(op.device_num_tokens),
    },
];

/// `ep_ll_combine`.
pub const LL_COMBINE: &[Pointer<LlCombineOp>] = &[
    Pointer {
        field: rows("x", Need::When(&[Cond::Send, Cond::Copy]), NOTHING_READ, 2),
        get: |op| cv(op.x),
    },
    Pointer {
        field: field(
            "topk_idx",
            Need::When(&[Cond::Recv, Cond::Tokens]),
            NOTHING_READ,
            4,
        ),
        get: |op| cv(op.topk_idx),
    },
    Pointer {
        field: field(
            "topk_weights",
            Need::WhenElseOptional(&[Cond::Unweighted]),
            "the weights given to the dispatch apply",
            4,
        ),
        get: |op| cv(op.topk_weights),
    },
    Pointer {
        field: field(
            "src_info",
            Need::Unused,
            "the context keeps the layout of its dispatch",
            4,
        ),
        get: |op| cv(op.src_info),
    },
    Pointer {
        field: field(
            "layout_range",
            Need::Unused,
            "the context keeps the layout of its dispatch",
            4,
        ),
        get: |op| cv(op.layout_range),
    },
    Pointer {
        field: rows(
            "out",
            Need::When(&[Cond::Recv, Cond::Tokens]),
            NOT_WRITTEN,
            2,
        ),
        get: |op| cv(op.out),
    },
    Pointer {
        field: field("device_num_tokens", Need::Optional, DEVICE_COUNT, 4),
        get: |op| cv(op.device_num_tokens),
    },
];

/// A fused call's pointer to the arguments of its half (host memory).
const fn args_struct(name: &'static str, need: Need) -> Field {
    Field {
        memory: Memory::Host,
        ..field(name, need, "not read", 8)
    }
}

/// Checks the one field `name` of `table` for NULL where `op` needs it: for
/// a pointer the C boundary must follow before it can build the rest of the
/// operation (a fused call's half).
pub fn check_field<Op>(table: &[Pointer<Op>], name: &str, op: &Op, facts: &Facts) -> Result<()> {
    for p in table.iter().filter(|p| p.field.name == name) {
        if p.field.required(facts) && (p.get)(op).is_null() {
            return Err(p.field.null_error());
        }
    }
    Ok(())
}

/// The fused calls' own pointers (`ep_mega_args_t`; their dispatch half
/// follows [`DISPATCH`] and their combine half [`COMBINE`]).
pub const MEGA: &[Pointer<MegaOp>] = &[
    Pointer {
        field: args_struct("dispatch", Need::When(&[Cond::FusedDispatch])),
        get: |op| op.dispatch_args,
    },
    Pointer {
        field: args_struct("combine", Need::When(&[Cond::FusedCombine])),
        get: |op| op.combine_args,
    },
    Pointer {
        field: rows("weights", Need::Always, "", 1),
        get: |op| cv(op.weights),
    },
    Pointer {
        field: field(
            "weight_scales",
            Need::When(&[Cond::Fp8Weights]),
            NOTHING_READ,
            4,
        ),
        get: |op| cv(op.weight_scales),
    },
    Pointer {
        field: rows("y", Need::Always, "", 2),
        get: |op| cv(op.y),
    },
    Pointer {
        field: field(
            "x_scales",
            Need::When(&[Cond::FusedCombine, Cond::Fp8Weights]),
            NOTHING_READ,
            4,
        ),
        get: |op| cv(op.x_scales),
    },
];

/// `ep_moe_forward`'s own pointers (`ep_moe_args_t`; its dispatch follows
/// [`DISPATCH`], with the expert-major output required, and its combine's
/// `out` follows [`COMBINE`]).
pub const MOE: &[Pointer<MoeExperts>] = &[
    Pointer {
        field: args_struct("dispatch", Need::Always),
        get: |op| op.dispatch_args,
    },
    Pointer {
        field: args_struct("combine", Need::Always),
        get: |op| op.combine_args,
    },
    Pointer {
        field: rows("w1", Need::Always, "", 1),
        get: |op| cv(op.w1),
    },
    Pointer {
        field: field(
            "w1_scales",
            Need::When(&[Cond::Fp8Weights]),
            NOTHING_READ,
            4,
        ),
        get: |op| cv(op.w1_scales),
    },
    Pointer {
        field: rows("w2", Need::Always, "", 1),
        get: |op| cv(op.w2),
    },
    Pointer {
        field: field(
            "w2_scales",
            Need::When(&[Cond::Fp8Weights]),
            NOTHING_READ,
            4,
        ),
        get: |op| cv(op.w2_scales),
    },
    Pointer {
        field: rows("y1", Need::Always, "", 2),
        get: |op| cv(op.y1),
    },
    Pointer {
        field: rows("act", Need::Always, "", 1),
        get: |op| cv(op.act),
    },
    Pointer {
        field: field(
            "act_scales",
            Need::When(&[Cond::Fp8Weights]),
            NOT_WRITTEN,
            4,
        ),
        get: |op| cv(op.act_scales),
    },
    Pointer {
        field: rows("y2", Need::Always, "", 2),
        get: |op| cv(op.y2),
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docs_read_as_sentences() {
        let x = &DISPATCH[0].field;
        assert_eq!(
            x.doc(),
            "Required when num_tokens > 0; may be NULL otherwise (then nothing is read)."
        );
        assert_eq!(DISPATCH[6].field.doc(), "May be NULL (then not written).");
        assert_eq!(MEGA[2].field.doc(), "Required.");
        let facts = Facts {
            tokens: true,
            ..Facts::default()
        };
        assert!(x.required(&facts));
        assert!(!x.required(&Facts::default()));
        assert!(x
            .null_error()
            .message
            .contains("`x` is NULL (required when num_tokens > 0)"));
    }

    #[test]
    fn wrong_memory_names_the_field_and_the_device() {
        let ptr = 0x1000 as *const c_void;
        let e = wrong_memory(&DISPATCH[0].field, ptr, "host memory", 3);
        assert_eq!(e.kind, crate::error::ErrorKind::InvalidArgument);
        assert_eq!(
            e.message,
            "`x` = 0x1000 is host memory, expected device memory of device 3"
        );
    }

    #[test]
    fn names_are_unique_per_table() {
        fn unique<Op>(table: &[Pointer<Op>]) {
            let mut names: Vec<&str> = fields(table).map(|f| f.name).collect();
            names.sort_unstable();
            let n = names.len();
            names.dedup();
            assert_eq!(names.len(), n);
        }
        unique(LAYOUT);
        unique(DISPATCH);
        unique(COMBINE);
        unique(LL_DISPATCH);
        unique(LL_COMBINE);
        unique(MEGA);
        unique(MOE);
    }
}
