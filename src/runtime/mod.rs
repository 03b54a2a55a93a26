//! The Rust runtime under the C boundary: configuration, validated
//! operations, the context, the bootstrap, and the two backends that run the
//! same operations (`host` on host memory, `gpu` on CUDA devices).

pub mod backend;
pub mod bootstrap;
pub mod config;
pub mod context;
pub mod contract;
pub mod cuda;
pub mod describe;
pub mod gpu;
pub mod group;
pub mod handle;
pub mod host;
pub mod log;
pub mod nccl;
pub mod ops;
pub mod sequence;
