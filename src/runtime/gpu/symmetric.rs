//! Symmetric memory: every rank allocates one communication buffer of the
//! same size with `cuMemCreate`, exports it as a POSIX file descriptor, sends
//! the descriptor to the other ranks of its host over the bootstrap's Unix
//! channel, and maps every peer's buffer into its own address space. A kernel
//! then reaches offset `o` of rank `r`'s buffer at `peer_bases[r] + o`, and
//! its stores travel over NVLink. Ranks that are threads of one process take
//! the same path (a descriptor imports within a process as well).
//!
//! NVLink multicast objects are never created: only unicast peer mappings.

use super::super::bootstrap::Bootstrap;
use super::super::cuda::{check, Device, DeviceBuffer};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

/// One mapped buffer: a physical allocation (ours or a peer's) and the
/// virtual range it is mapped at; unmapped and released on drop.
struct Mapping {
    device: Device,
    handle: sys::CUmemGenericAllocationHandle,
    base: sys::CUdeviceptr,
    size: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let Ok(_context) = self.device.bind() else {
            return;
        };
        // SAFETY: undoes `map` and drops our reference to the handle; the
        // results are ignored, as a destructor cannot report them.
        unsafe {
            sys::cuMemUnmap(self.base, self.size);
            sys::cuMemAddressFree(self.base, self.size);
            sys::cuMemRelease(self.handle);
        }
    }
}

/// This rank's buffer and the mappings of every peer's, index = rank.
pub struct SymmetricMemory {
    mappings: Vec<Mapping>,
    /// `[world]` device pointers to every rank's buffer, for kernels.
    peer_bases: DeviceBuffer,
    size: usize,
}

// SAFETY: the handles and addresses are plain values; the driver API is
// thread-safe.
unsafe impl Send for SymmetricMemory {}

fn allocation_prop(device: &Device) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is a valid starting point.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device.ordinal() as i32;
    prop
}

/// Maps an allocation handle at a fresh virtual range, readable and writable
/// from `device`. Takes over the reference to `handle`, also on failure.
fn map(device: &Device, handle: sys::CUmemGenericAllocationHandle, size: usize) -> Result<Mapping> {
    let mut base = 0;
    // SAFETY: reserves and maps a range of `size` bytes (a multiple of the
    // granularity) for a handle we own a reference to.
    unsafe {
        let reserved = check(
            sys::cuMemAddressReserve(&mut base, size, 0, 0, 0),
            "cuMemAddressReserve",
        );
        if let Err(err) = reserved {
            sys::cuMemRelease(handle);
            return Err(err);
        }
        let mapped = check(sys::cuMemMap(base, size, 0, handle, 0), "cuMemMap");
        if let Err(err) = mapped {
            sys::cuMemAddressFree(base, size);
            sys::cuMemRelease(handle);
            return Err(err);
        }
        let access = sys::CUmemAccessDesc {
            location: allocation_prop(device).location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        if let Err(err) = check(
            sys::cuMemSetAccess(base, size, &access, 1),
            "cuMemSetAccess",
        ) {
            sys::cuMemUnmap(base, size);
            sys::cuMemAddressFree(base, size);
            sys::cuMemRelease(handle);
            return Err(err);
        }
    }
    Ok(Mapping {
        device: device.clone(),
        handle,
        base,
        size,
    })
}

impl SymmetricMemory {
    /// Allocates `bytes` (rounded up to the allocation granularity) on every
    /// rank and maps all of them on all ranks, zero-filled. Collective: every
    /// rank of `boot` calls it with the same size.
    pub fn new(device: &Device, boot: &Bootstrap, bytes: usize) -> Result<SymmetricMemory> {
        if boot.local_ranks().len() != boot.world() {
            return Err(Error::unsupported(
                "the GPU backend connects ranks over NVLink and needs them on one host",
            ));
        }
        let _context = device.bind()?;
        let prop = allocation_prop(device);
        let mut granularity = 0;
        // SAFETY: writes one usize.
        check(
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            },
            "cuMemGetAllocationGranularity",
        )?;
        let size = bytes.max(1).div_ceil(granularity) * granularity;

        let mut own = 0;
        // SAFETY: creates one physical allocation, owned by `own_mapping`.
        check(
            unsafe { sys::cuMemCreate(&mut own, size, &prop, 0) },
            "cuMemCreate",
        )?;
        let own_mapping = map(device, own, size)?;
        let mut raw_fd: i32 = -1;
        // SAFETY: writes one int (the descriptor) for a handle we own.
        check(
            unsafe {
                sys::cuMemExportToShareableHandle(
                    &mut raw_fd as *mut i32 as *mut std::ffi::c_void,
                    own,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            "cuMemExportToShareableHandle",
        )?;
        // SAFETY: the driver gave us a new descriptor that nothing else owns.
        let own_fd = unsafe { OwnedFd::from_raw_fd(raw_fd) };

        let fds = boot.all_gather_fds(own_fd.as_fd())?;
        let mut own_mapping = Some(own_mapping);
        let mut mappings = Vec::with_capacity(boot.world());
        for (rank, fd) in fds.iter().enumerate() {
            if rank == boot.rank() {
                mappings.extend(own_mapping.take());
                continue;
            }
            let fd = fd
                .as_ref()
                .ok_or_else(|| Error::internal(format!("rank {rank} sent no buffer")))?;
            let mut handle = 0;
            // SAFETY: imports a descriptor the peer exported; the driver
            // takes the descriptor's number in the pointer argument.
            check(
                unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut handle,
                        fd.as_raw_fd() as isize as *mut std::ffi::c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                },
                "cuMemImportFromShareableHandle",
            )?;
            mappings.push(map(device, handle, size)?);
        }
        let memory = SymmetricMemory {
            mappings,
            peer_bases: DeviceBuffer::new(device, boot.world() * 8)?,
            size,
        };
        let bases: Vec<u64> = memory.mappings.iter().map(|m| m.base).collect();
        // SAFETY: synchronous copy to a buffer of `world` u64s; zero-fill of
        // our own mapping.
        unsafe {
            check(
                sys::cuMemcpyHtoD_v2(
                    memory.peer_bases.ptr(),
                    bases.as_ptr() as *const _,
                    bases.len() * 8,
                ),
                "cuMemcpyHtoD",
            )?;
            check(
                sys::cuMemsetD8_v2(memory.base(boot.rank()), 0, size),
                "cuMemsetD8",
            )?;
            check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        // Nobody may write into a peer's buffer before the peer has zeroed it.
        boot.barrier()?;
        Ok(memory)
    }

    /// Device address of rank `rank`'s buffer, as mapped on this rank.
    pub fn base(&self, rank: usize) -> sys::CUdeviceptr {
        self.mappings[rank].base
    }

    /// Device array `[world]` of every rank's buffer address, for kernels.
    pub fn peer_bases(&self) -> sys::CUdeviceptr {
        self.peer_bases.ptr()
    }

    /// Bytes of each rank's buffer.
    pub fn size(&self) -> usize {
        self.size
    }
}
