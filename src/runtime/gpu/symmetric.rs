//! Symmetric memory: every rank has one communication buffer of the same
//! size, and a kernel reaches offset `o` of rank `r`'s buffer at
//! `peer_bases[r] + o` for every rank `r` its GPU can load from and store to
//! (over NVLink); its stores travel over NVLink. Ranks its GPU cannot reach
//! (other nodes) have a 0 entry: the network leg reaches them.
//!
//! Two implementations behind [`SymmetricMemory`], so every mode runs on
//! either:
//! - [`NativeMemory`]: each rank allocates with `cuMemCreate`, exports the
//!   allocation as a POSIX file descriptor, sends it to the other ranks of
//!   its host over the bootstrap's Unix channel, and maps every peer's
//!   buffer. One host only. Ranks that share a GPU (threads of one process,
//!   see `placement`) do not map each other's buffers again: they use the
//!   owner's own mapping (see "Ranks sharing a GPU" below).
//! - [`NcclMemory`]: `ncclMemAlloc` + `ncclCommWindowRegister` (a symmetric
//!   window) on an NCCL communicator; the peers of the LSA team (NCCL's
//!   load/store-accessible ranks) are reached through `ncclGetLsaPointer`,
//!   and a device communicator (`ncclDevCommCreate`) serves the network
//!   kernels (GIN) for the other ranks.
//!
//! NVLink multicast objects are never created: only unicast peer mappings.
//!
//! # Ranks sharing a GPU
//! Two mappings of one allocation on one GPU are *virtual aliases*, and CUDA
//! keeps aliases coherent only at kernel boundaries: a store through one
//! alias may stay invisible, for as long as a kernel runs, to a kernel that
//! was already running and loads through the other (CUDA Programming Guide,
//! "Virtual Aliasing Support"). Every wait of ep is such a kernel (the
//! barrier polls its own slots while the peers store into them), so with
//! aliases a waiting rank could miss a peer's signal for good. Therefore
//! every buffer on a GPU is reached through one virtual address only: each
//! rank publishes its own mapping in a table of this process
//! ([`OWN_MAPPINGS`]), and a rank on the same GPU shares it (an `Arc`, so the
//! buffer stays mapped until its last user has gone) instead of importing
//! the descriptor. Peers on other GPUs map the buffer themselves: their
//! accesses cross NVLink to the owner's memory, which is not an alias.

use super::super::bootstrap::Bootstrap;
use super::super::cuda::{check, Device, DeviceBuffer};
use super::super::group::HostGroup;
use super::super::nccl::{self, CommHandle, DevComm, DevCommRequirements, Nccl, Window};
use super::Kernels;
use crate::abi::NcclPeerBasesParams;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// What the network kernels need of an NCCL context: device addresses of
/// the window's description and of the device communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclDevice {
    /// `ncclWindow_t` of the symmetric buffer.
    pub window: u64,
    /// An `ncclDevComm` in device memory.
    pub dev_comm: u64,
    /// The device communicator has GIN contexts and signals (the network
    /// leg can use GIN); false where NCCL has no network to offer.
    pub gin: bool,
}

/// One rank's view of the symmetric buffers.
pub trait SymmetricMemory: Send {
    /// Device address of this rank's buffer.
    fn own_base(&self) -> u64;
    /// Device array `[world]` of every rank's buffer as mapped here; 0 for
    /// a rank this GPU cannot reach by loads and stores (and only for one).
    fn peer_bases(&self) -> u64;
    /// Host copy of `peer_bases`: non-zero entries are the ranks this GPU
    /// reaches.
    fn host_peer_bases(&self) -> &[u64];
    /// The NCCL handles of the buffer, for the network kernels; `None` for
    /// native memory.
    fn nccl(&self) -> Option<NcclDevice>;
}

/// One mapped buffer: a physical allocation (ours or a peer's) and the
/// virtual range it is mapped at; unmapped and released on drop.
struct Mapping {
    device: Device,
    handle: sys::CUmemGenericAllocationHandle,
    base: sys::CUdeviceptr,
    size: usize,
}

// SAFETY: a handle and an address are plain values, and the driver API is
// thread-safe; ranks that share a mapping only read its fields.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

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

/// The buffers of this process's ranks, by base address: where ranks
/// sharing a GPU find each other's mapping (see "Ranks sharing a GPU").
/// Entries of dropped mappings are pruned when the table is next used.
static OWN_MAPPINGS: Mutex<Vec<(u64, Weak<Mapping>)>> = Mutex::new(Vec::new());

/// Lists `mapping` (a rank's own buffer) in [`OWN_MAPPINGS`].
fn publish(mapping: &Arc<Mapping>) {
    let mut table = OWN_MAPPINGS.lock().unwrap_or_else(PoisonError::into_inner);
    table.retain(|(_, weak)| weak.strong_count() > 0);
    table.push((mapping.base, Arc::downgrade(mapping)));
}

/// The live mapping of this process listed at `base`, if any.
fn published(base: u64) -> Option<Arc<Mapping>> {
    let table = OWN_MAPPINGS.lock().unwrap_or_else(PoisonError::into_inner);
    table
        .iter()
        .filter(|(b, _)| *b == base)
        .find_map(|(_, weak)| weak.upgrade())
}

/// This rank's buffer and the mappings of every peer's, index = rank (a
/// peer on this GPU: the peer's own mapping, shared).
pub struct NativeMemory {
    mappings: Vec<Arc<Mapping>>,
    /// `[world]` device pointers to every rank's buffer, for kernels.
    peer_bases: DeviceBuffer,
    host_bases: Vec<u64>,
    rank: usize,
}

// SAFETY: the handles and addresses are plain values; the driver API is
// thread-safe.
unsafe impl Send for NativeMemory {}

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

impl NativeMemory {
    /// Allocates `bytes` (rounded up to the allocation granularity) on every
    /// rank and maps all of them on all ranks, zero-filled. Collective: every
    /// rank of `boot` calls it with the same size. `sharing`: the ranks on
    /// this rank's GPU (threads of this process), which are reached through
    /// their own mappings.
    pub fn new(
        device: &Device,
        boot: &Bootstrap,
        bytes: usize,
        sharing: &[usize],
    ) -> Result<NativeMemory> {
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
        let own_mapping = Arc::new(map(device, own, size)?);
        publish(&own_mapping);
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
        let own_bases = boot.all_gather(&own_mapping.base.to_le_bytes())?;
        let mut own_mapping = Some(own_mapping);
        let mut mappings = Vec::with_capacity(boot.world());
        for (rank, fd) in fds.iter().enumerate() {
            if rank == boot.rank() {
                mappings.extend(own_mapping.take());
                continue;
            }
            if sharing.contains(&rank) {
                // The peer published its mapping before the all-gathers.
                let base = own_bases[rank]
                    .as_slice()
                    .try_into()
                    .map(u64::from_le_bytes)
                    .map_err(|_| Error::remote(format!("rank {rank} sent a malformed address")))?;
                let shared = published(base).ok_or_else(|| {
                    Error::remote(format!(
                        "rank {rank} shares this GPU but its buffer is not mapped in this process \
                         (it left the group during create)"
                    ))
                })?;
                mappings.push(shared);
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
            mappings.push(Arc::new(map(device, handle, size)?));
        }
        // Every rank is mapped: no base is 0.
        let bases: Vec<u64> = mappings.iter().map(|m| m.base).collect();
        let memory = NativeMemory {
            mappings,
            peer_bases: DeviceBuffer::from_host(device, &bases)?,
            host_bases: bases,
            rank: boot.rank(),
        };
        // SAFETY: zero-fill of our own mapping.
        unsafe {
            check(sys::cuMemsetD8_v2(memory.own_base(), 0, size), "cuMemsetD8")?;
            check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        // Nobody may write into a peer's buffer before the peer has zeroed it.
        boot.barrier()?;
        Ok(memory)
    }
}

impl SymmetricMemory for NativeMemory {
    fn own_base(&self) -> u64 {
        self.mappings[self.rank].base
    }

    fn peer_bases(&self) -> u64 {
        self.peer_bases.ptr()
    }

    fn host_peer_bases(&self) -> &[u64] {
        &self.host_bases
    }

    fn nccl(&self) -> Option<NcclDevice> {
        None
    }
}

/// Threads of the kernel that reads the window's LSA pointers.
const PEER_BASES_THREADS: u32 = 64;
/// Window sizes are multiples of this (NCCL's allocation granularity on
/// current GPUs; a multiple of `NCCL_WIN_REQUIRED_ALIGNMENT`).
const WINDOW_GRANULARITY: usize = 2 << 20;

/// The symmetric buffer as an NCCL window; see the module comment.
pub struct NcclMemory {
    nccl: &'static Nccl,
    comm: Arc<CommHandle>,
    device: Device,
    /// What `ncclMemAlloc` returned.
    allocation: u64,
    window: Window,
    dev_comm: DevComm,
    /// `dev_comm` copied to device memory, for the kernels.
    dev_comm_on_device: DeviceBuffer,
    gin: bool,
    peer_bases: DeviceBuffer,
    host_bases: Vec<u64>,
    /// This rank's buffer as its kernels address it (its own LSA pointer).
    own_base: u64,
}

// SAFETY: the handles and addresses are plain values; NCCL's and the
// driver's calls on them are made by one thread at a time.
unsafe impl Send for NcclMemory {}

impl NcclMemory {
    /// Allocates and registers `bytes` (rounded up) on every rank of
    /// `comm`, zero-filled, and creates the device communicator, with
    /// `gin_signals` GIN signals when non-zero. Collective over the
    /// communicator (every rank calls it with the same sizes); `group`
    /// carries the closing barrier.
    pub fn new(
        comm: Arc<CommHandle>,
        device: &Device,
        kernels: &Kernels,
        group: &dyn HostGroup,
        bytes: usize,
        gin_signals: usize,
    ) -> Result<NcclMemory> {
        let nccl = comm.nccl;
        let world = group.world();
        let size = bytes.max(1).div_ceil(WINDOW_GRANULARITY) * WINDOW_GRANULARITY;
        let _context = device.bind()?;
        let allocation = nccl.mem_alloc(size)?;
        // From here on, drop undoes whatever was set up.
        let mut memory = NcclMemory {
            nccl,
            comm,
            device: device.clone(),
            allocation,
            window: std::ptr::null_mut(),
            dev_comm: DevComm::zeroed(),
            dev_comm_on_device: DeviceBuffer::new(device, nccl::DEV_COMM_BYTES)?,
            gin: false,
            peer_bases: DeviceBuffer::new(device, world * 8)?,
            host_bases: vec![0; world],
            own_base: 0,
        };
        // SAFETY: zero-fills our own allocation, synchronously.
        unsafe {
            check(sys::cuMemsetD8_v2(allocation, 0, size), "cuMemsetD8")?;
            check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        let comm = memory.comm.comm;
        // SAFETY: a live communicator; the allocation is NCCL's and lives
        // as long as the window (both freed in drop, window first).
        memory.window = unsafe { nccl.window_register(comm, allocation, size)? };
        let mut requirements = DevCommRequirements {
            lsa_barrier_count: 1,
            ..DevCommRequirements::default()
        };
        if gin_signals > 0 {
            requirements.gin_context_count = 1;
            requirements.gin_signal_count = gin_signals as i32;
        }
        // SAFETY: a live communicator.
        memory.dev_comm = unsafe { nccl.dev_comm_create(comm, &requirements)? };
        memory.gin = gin_signals > 0;
        memory.find_peers(kernels, group.rank())?;
        // SAFETY: synchronous copy of the host struct into its buffer.
        unsafe {
            check(
                sys::cuMemcpyHtoD_v2(
                    memory.dev_comm_on_device.ptr(),
                    memory.dev_comm.bytes.as_ptr().cast(),
                    nccl::DEV_COMM_BYTES,
                ),
                "cuMemcpyHtoD",
            )?;
        }
        // Nobody may write into a peer's buffer before the peer has zeroed it.
        group.barrier()?;
        Ok(memory)
    }

    /// Fills `peer_bases` with the LSA pointers of the window for the ranks
    /// of this rank's LSA team (consecutive world ranks) and 0 for the
    /// others, with a kernel (LSA pointers are device-side functions).
    fn find_peers(&mut self, kernels: &Kernels, rank: usize) -> Result<()> {
        let (lsa_rank, lsa_size) = (self.dev_comm.lsa_rank(), self.dev_comm.lsa_size());
        let world = self.host_bases.len();
        if lsa_rank >= lsa_size || lsa_rank > rank || rank - lsa_rank + lsa_size > world {
            return Err(Error::internal(format!(
                "NCCL reports LSA rank {lsa_rank} of {lsa_size} for rank {rank} of {world}"
            )));
        }
        let first = rank - lsa_rank;
        let params = NcclPeerBasesParams {
            window: self.window as u64,
            peer_bases: self.peer_bases.ptr(),
            first_lsa_rank: first as i32,
            lsa_size: lsa_size as i32,
            world: world as i32,
        };
        let mut bases = vec![0u64; world];
        let guard = self.device.bind()?;
        // SAFETY: the parameters point to our own buffers; the null stream
        // is synchronized before the table is read back.
        unsafe {
            kernels.nccl_peer_bases.launch(
                &guard,
                1,
                PEER_BASES_THREADS,
                0,
                std::ptr::null_mut(),
                &params,
            )?;
            check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
            check(
                sys::cuMemcpyDtoH_v2(bases.as_mut_ptr().cast(), params.peer_bases, world * 8),
                "cuMemcpyDtoH",
            )?;
        }
        self.own_base = bases[rank];
        if self.own_base == 0 {
            return Err(Error::internal("NCCL gave no LSA pointer for this rank"));
        }
        // A 0 entry must mean "not reachable" (`SymmetricMemory`).
        if let Some(r) = (first..first + lsa_size).find(|&r| bases[r] == 0) {
            return Err(Error::internal(format!(
                "NCCL gave no LSA pointer for rank {r} of this rank's LSA team"
            )));
        }
        self.host_bases = bases;
        Ok(())
    }
}

impl SymmetricMemory for NcclMemory {
    fn own_base(&self) -> u64 {
        self.own_base
    }

    fn peer_bases(&self) -> u64 {
        self.peer_bases.ptr()
    }

    fn host_peer_bases(&self) -> &[u64] {
        &self.host_bases
    }

    fn nccl(&self) -> Option<NcclDevice> {
        Some(NcclDevice {
            window: self.window as u64,
            dev_comm: self.dev_comm_on_device.ptr(),
            gin: self.gin,
        })
    }
}

impl Drop for NcclMemory {
    fn drop(&mut self) {
        let Ok(_context) = self.device.bind() else {
            return;
        };
        let comm = self.comm.comm;
        // SAFETY: undoes `new` in reverse order; no kernel uses the buffer
        // any more (the API's rule for ep_ctx_destroy).
        unsafe {
            if self.dev_comm.lsa_size() > 0 {
                self.nccl.dev_comm_destroy(comm, &self.dev_comm);
            }
            if !self.window.is_null() {
                self.nccl.window_deregister(comm, self.window);
            }
            self.nccl.mem_free(self.allocation);
        }
    }
}
