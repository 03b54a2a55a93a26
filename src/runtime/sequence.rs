//! The numbering of collective calls, which lets every rank check that its
//! peers are in the same call as itself.
//!
//! # Rule
//! Every rank of a context calls the collective operations ([`Collective`])
//! in the same order. Each context counts them: the first collective call
//! that passes its local checks is call 1, the next one call 2, and so on,
//! whatever the operation. A call that fails its local checks (argument
//! validation, the backend's checks of the caller's arrays) is not made:
//! it takes no number, communicates nothing and leaves the context as it
//! was. A call that passed them keeps its number even if it then fails.
//! A low-latency call split into `EP_LL_SEND_ONLY` and `EP_LL_RECV_ONLY`
//! halves is one call: the receive half has the number of its send half.
//! `ep_moe_forward` is two calls, its dispatch and its combine
//! ([`Collective::MoeDispatch`], [`Collective::MoeCombine`]), which take
//! two consecutive numbers when the call passes its checks.
//!
//! So the n-th call that one rank makes is the n-th call of every other
//! rank, whatever failed locally in between. A rank whose call failed its
//! checks simply makes that call later (or not at all): if its next call is
//! the same operation, the peers' calls pair with it; if it is another
//! operation, every rank sees the mismatch.
//!
//! # Where the numbers travel
//! Every step of a collective carries its [`Call`]: the operation's stable
//! code, the call number, and for a combine the number of the dispatch it
//! combines ([`Call::pairs_with`]). A rank that receives another tag than
//! its own stops with `EP_ERR_REMOTE`, and so does every other rank (they
//! all see every tag), naming both ranks' calls: never stale data, never a
//! wait until the timeout.
//! - The host backend all-gathers the tag at each of its two steps.
//! - The GPU backend's kernels number the calls in device memory (one
//!   counter per context, advanced by the first kernel of every collective
//!   launch), since a call captured in a CUDA graph keeps the number it had
//!   at capture while each replay is a new call; for calls made directly
//!   the numbers are this count's. Each call publishes its call word (the
//!   operation's code and the number, `abi::CALL_NUMBER_BITS`), the
//!   barrier's signals carry it, and every device wait reads the peer's
//!   word: a peer in another call ends the wait at once with a mismatch
//!   (`EP_ERR_REMOTE`, naming both calls) instead of a timeout, and no
//!   kernel uses what a peer wrote for another call
//!   (kernels/include/ep_device.cuh, "Collective calls"). Call numbers start
//!   at 1, so zero-filled signal memory never matches a call.

use std::fmt;

/// The collective operations, with the codes that travel between ranks.
/// The codes are part of the wire format: never renumber them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Collective {
    Dispatch = 1,
    Combine = 2,
    LlDispatch = 3,
    LlCombine = 4,
    MegaDispatch = 5,
    MegaCombine = 6,
    /// `ep_moe_forward`'s dispatch (with the gate+up GEMM) and its combine
    /// (with the down GEMM).
    MoeDispatch = 7,
    MoeCombine = 8,
}

/// Every collective operation.
const COLLECTIVES: [Collective; 8] = [
    Collective::Dispatch,
    Collective::Combine,
    Collective::LlDispatch,
    Collective::LlCombine,
    Collective::MegaDispatch,
    Collective::MegaCombine,
    Collective::MoeDispatch,
    Collective::MoeCombine,
];

impl Collective {
    pub fn code(self) -> u32 {
        self as u32
    }

    pub fn from_code(code: u32) -> Option<Collective> {
        COLLECTIVES.into_iter().find(|c| c.code() == code)
    }

    /// The C function that makes this call (and which of its calls, for
    /// `ep_moe_forward`).
    pub fn function(self) -> &'static str {
        match self {
            Collective::Dispatch => "ep_dispatch",
            Collective::Combine => "ep_combine",
            Collective::LlDispatch => "ep_ll_dispatch",
            Collective::LlCombine => "ep_ll_combine",
            Collective::MegaDispatch => "ep_mega_dispatch_gemm",
            Collective::MegaCombine => "ep_mega_gemm_combine",
            Collective::MoeDispatch => "ep_moe_forward (dispatch)",
            Collective::MoeCombine => "ep_moe_forward (combine)",
        }
    }
}

/// One collective call of a context, as every rank must see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    pub op: Collective,
    /// The call number (from 1; see the module doc).
    pub number: u64,
    /// For a combine: the number of the dispatch whose layout it returns
    /// (normal mode: the handle's dispatch; low-latency: the context's last
    /// dispatch). 0 for a dispatch.
    pub pairs_with: u64,
}

/// Bytes of an encoded [`Call`] with its step.
pub(crate) const TAG_BYTES: usize = 24;

impl Call {
    /// The call and the step within it (0, 1, ...), as 24 little-endian
    /// bytes: code (u32), step (u32), number (u64), pairs_with (u64).
    pub fn tag(&self, step: u32) -> [u8; TAG_BYTES] {
        let mut out = [0u8; TAG_BYTES];
        out[0..4].copy_from_slice(&self.op.code().to_le_bytes());
        out[4..8].copy_from_slice(&step.to_le_bytes());
        out[8..16].copy_from_slice(&self.number.to_le_bytes());
        out[16..24].copy_from_slice(&self.pairs_with.to_le_bytes());
        out
    }

    /// Decodes a tag from a peer: the call (if the code is known; else the
    /// raw code) and the step.
    pub fn from_tag(tag: &[u8]) -> Option<(std::result::Result<Call, u32>, u32)> {
        if tag.len() != TAG_BYTES {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(tag[i..i + 4].try_into().unwrap_or_default());
        let u64_at = |i: usize| u64::from_le_bytes(tag[i..i + 8].try_into().unwrap_or_default());
        let (code, step) = (u32_at(0), u32_at(4));
        let call = Collective::from_code(code).map(|op| Call {
            op,
            number: u64_at(8),
            pairs_with: u64_at(16),
        });
        Some((call.ok_or(code), step))
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} call #{}", self.op.function(), self.number)?;
        if self.pairs_with != 0 {
            write!(f, " (combining the dispatch of call #{})", self.pairs_with)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip() {
        let call = Call {
            op: Collective::LlCombine,
            number: 7,
            pairs_with: 6,
        };
        let (back, step) = Call::from_tag(&call.tag(1)).unwrap();
        assert_eq!((back, step), (Ok(call), 1));
        let mut odd = call.tag(0);
        odd[0] = 99;
        assert_eq!(Call::from_tag(&odd).unwrap().0, Err(99));
        assert!(Call::from_tag(&[0; 3]).is_none());
        assert_eq!(
            call.to_string(),
            "ep_ll_combine call #7 (combining the dispatch of call #6)"
        );
        for c in COLLECTIVES {
            assert_eq!(Collective::from_code(c.code()), Some(c));
        }
    }
}
