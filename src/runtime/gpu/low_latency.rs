//! Low-latency mode on GPUs: one-kernel FP8 dispatch and combine for decode.

use super::Runtime;
use crate::error::{Error, Result};
use crate::runtime::backend::Stream;
use crate::runtime::config::Config;
use crate::runtime::ops::{LlCombineOp, LlDispatchOp};

/// Bytes of symmetric buffer the low-latency mode needs for `cfg`.
pub fn buffer_bytes(_cfg: &Config) -> usize {
    0
}

pub struct LlMode {}

impl LlMode {
    /// The mode's area starts at `offset` of every rank's symmetric buffer.
    pub fn new(_rt: &Runtime, _offset: usize) -> Result<LlMode> {
        Ok(LlMode {})
    }

    pub fn dispatch(&mut self, _rt: &Runtime, _op: &LlDispatchOp, _stream: Stream) -> Result<()> {
        Err(Error::unsupported(
            "the low-latency dispatch is not available on the GPU backend in this build",
        ))
    }

    pub fn combine(&mut self, _rt: &Runtime, _op: &LlCombineOp, _stream: Stream) -> Result<()> {
        Err(Error::unsupported(
            "the low-latency combine is not available on the GPU backend in this build",
        ))
    }

    pub fn combine_buffer(&mut self, _rt: &Runtime) -> Result<(*mut u8, usize)> {
        Err(Error::unsupported(
            "the low-latency combine buffer is not available on the GPU backend in this build",
        ))
    }
}
