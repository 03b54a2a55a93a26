//! What the GPU backend checks of a caller's pointers and streams before a
//! call is made: memory the kernels can use, and a stream of this device.
//!
//! Memory (the contract's `Memory::Device` fields): the driver says what a
//! pointer is (`cuPointerGetAttributes`). Accepted: device memory of this
//! context's device (`cuMemAlloc`, a memory pool, `cuMemCreate` mappings,
//! this context's own buffers), managed memory, and pinned host memory
//! mapped for the device (`cuMemHostAlloc`, `cuMemHostRegister`), which the
//! kernels reach over PCIe: correct, but every access crosses the bus, so it
//! suits small arrays only. Refused, before anything is enqueued, with
//! `EP_ERR_INVALID_ARGUMENT` naming the field: memory the driver does not know
//! (pageable host memory, or a stray address), device memory of another
//! device, and pinned host memory that is not mapped for the device. A kernel
//! would fault on any of them, and a fault kills the caller's CUDA context.
//!
//! Streams: NULL, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` are this
//! thread's streams of the current device; any other stream must belong to
//! the device's primary context, where the library launches its kernels.

use super::super::backend::Stream;
use super::super::contract::{wrong_memory, Field};
use super::super::cuda::{check, Device, STREAM_LEGACY, STREAM_PER_THREAD};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::c_void;

/// What the driver knows of an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Not CUDA memory: pageable host memory, or no memory at all.
    Unknown,
    /// Device memory of the device with this ordinal.
    Device { ordinal: i32 },
    /// Managed (unified) memory.
    Managed,
    /// Pinned host memory; `mapped`: the device reaches it at this address.
    Host { mapped: bool },
}

/// Asks the driver what `ptr` is.
pub fn kind_of(ptr: *const c_void) -> Result<Kind> {
    let mut attributes = [
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
    ];
    // Each value gets 8 zeroed bytes, more than any of them takes (an
    // unsigned int, an int, a bool, a CUdeviceptr): what the driver leaves
    // unwritten reads as 0.
    let mut values = [0u64; 4];
    let mut data: [*mut c_void; 4] = [std::ptr::null_mut(); 4];
    for (slot, value) in data.iter_mut().zip(values.iter_mut()) {
        *slot = (value as *mut u64).cast();
    }
    // SAFETY: four attributes, each with room for its value. For an address
    // the driver does not know, it succeeds and leaves the values zero.
    check(
        unsafe {
            sys::cuPointerGetAttributes(
                attributes.len() as u32,
                attributes.as_mut_ptr(),
                data.as_mut_ptr(),
                ptr as sys::CUdeviceptr,
            )
        },
        "cuPointerGetAttributes",
    )?;
    let [memory_type, ordinal, managed, device_pointer] = values;
    if managed as u8 != 0 {
        return Ok(Kind::Managed);
    }
    const DEVICE: u32 = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
    const HOST: u32 = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
    Ok(match memory_type as u32 {
        DEVICE => Kind::Device {
            ordinal: ordinal as u32 as i32,
        },
        HOST => Kind::Host {
            mapped: device_pointer == ptr as u64,
        },
        _ => Kind::Unknown,
    })
}

/// Checks that kernels on `device` can use `ptr` (not NULL) for `field`.
pub fn device_memory(device: &Device, field: &Field, ptr: *const c_void) -> Result<()> {
    let ordinal = device.ordinal() as i32;
    let kind = kind_of(ptr).map_err(|e| {
        let what = format!("memory the CUDA driver cannot describe ({})", e.message);
        wrong_memory(field, ptr, &what, ordinal)
    })?;
    let what = match kind {
        Kind::Device { ordinal: o } if o == ordinal => return Ok(()),
        Kind::Managed | Kind::Host { mapped: true } => return Ok(()),
        Kind::Device { ordinal: o } => format!("device memory of device {o}"),
        Kind::Host { mapped: false } => "pinned host memory not mapped for the device".into(),
        Kind::Unknown => "host memory (or no memory) that CUDA does not know".into(),
    };
    Err(wrong_memory(field, ptr, &what, ordinal))
}

/// Checks that this context's kernels may be enqueued on `stream`: a
/// stream of `device`'s primary context.
pub fn stream(device: &Device, stream: Stream) -> Result<()> {
    let handle = stream as usize;
    if handle == 0 || handle == STREAM_LEGACY || handle == STREAM_PER_THREAD {
        return Ok(());
    }
    let mut context = std::ptr::null_mut();
    // SAFETY: writes one context handle; the caller vouches that `stream`
    // is a live stream (API rule).
    check(
        unsafe { sys::cuStreamGetCtx(stream as sys::CUstream, &mut context) },
        "cuStreamGetCtx",
    )
    .map_err(|e| {
        Error::invalid(format!(
            "`stream` = {stream:p} is not a stream: {}",
            e.message
        ))
    })?;
    if context == device.primary_context() {
        return Ok(());
    }
    let mut stream_device = -1;
    // SAFETY: writes one CUdevice of a live stream.
    let res = unsafe { sys::cuStreamGetDevice(stream as sys::CUstream, &mut stream_device) };
    let whose = if res != sys::CUresult::CUDA_SUCCESS {
        "an unknown device".to_string()
    } else if stream_device == device.handle() {
        format!(
            "device {} but of another CUDA context than its primary one",
            device.ordinal()
        )
    } else {
        format!("device {stream_device}")
    };
    Err(Error::invalid(format!(
        "`stream` = {stream:p} is a stream of {whose}; this context runs on device {} \
         (its primary context, which the CUDA runtime and PyTorch use)",
        device.ordinal()
    )))
}
