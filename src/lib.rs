//! `ep`: expert-parallel token dispatch and combine for Mixture-of-Experts
//! models, built as a C-ABI library (`libep.so`, header `include/ep.h`).
//!
//! Layers, top to bottom:
//! - [`capi`]: the C boundary: `#[repr(C)]` types and `extern "C"` functions
//!   only. Every entry point checks its pointers and struct headers and runs
//!   inside `catch_unwind`.
//! - [`runtime`]: validated configuration and operations, the context, the
//!   bootstrap, and the two backends behind one interface: `host` (reference
//!   code on host memory) and `gpu` (CUDA kernels over NVLink).
//! - [`reference`]: plain Rust that defines what every operation computes.
//! - [`abi`]: the structs and constants the runtime and the kernels share,
//!   defined once; `build.rs` generates the kernels' `ep_abi.h` from them.
//! - `kernels/*.cu`: the CUDA kernels, built by `build.rs` into one fatbin.

pub mod abi;
pub mod capi;
pub mod error;
pub mod reference;
pub mod runtime;
