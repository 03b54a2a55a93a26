//! NCCL, loaded at run time: the library links no NCCL (nor CUDA) library.
//!
//! Which copy: the one already loaded in the process (`dlopen` of
//! `libnccl.so.2` with `RTLD_NOLOAD`, such as PyTorch's or the caller's),
//! else the file named by `EP_NCCL_LIBRARY`, else `libnccl.so.2` from the
//! loader's search path. A communicator passed to `ep_ctx_create_from_nccl`
//! must come from that copy.
//!
//! Version: the network kernels are compiled against the device-API headers
//! of one NCCL release (`EP_NCCL_VERSION_CODE`, from the pinned
//! `nvidia-nccl-cu13` wheel), and NCCL's device API is not compatible across
//! releases: any other version is refused with a message naming both.
//!
//! Only the entry points ep needs are resolved; each wrapper turns an
//! `ncclResult_t` into an [`Error`] that carries NCCL's own message.

use crate::error::{Error, ErrorKind, Result};
use once_cell::sync::OnceCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};

/// `ncclComm_t`.
pub type Comm = *mut c_void;
/// `ncclWindow_t`: a device pointer to NCCL's description of a window.
pub type Window = *mut c_void;
type NcclResult = c_int;
type Stream = *mut c_void;

const NCCL_SUCCESS: NcclResult = 0;
/// `ncclUint8` of `ncclDataType_t`.
const NCCL_UINT8: c_int = 1;
/// `NCCL_WIN_COLL_SYMMETRIC`: the window is registered by every rank with
/// the same size, and peers' copies are reachable through LSA pointers.
pub(crate) const WIN_COLL_SYMMETRIC: c_int = 1;

/// The NCCL version ep's network kernels were compiled against
/// (`NCCL_VERSION_CODE` of the headers build.rs used).
pub(crate) const BUILT_VERSION: i32 = parse_code(env!("EP_NCCL_VERSION_CODE"));

const fn parse_code(text: &str) -> i32 {
    let bytes = text.as_bytes();
    let mut value = 0;
    let mut i = 0;
    while i < bytes.len() {
        value = value * 10 + (bytes[i] - b'0') as i32;
        i += 1;
    }
    value
}

/// "2.28.9" for 22809 (NCCL's `major * 10000 + minor * 100 + patch`).
pub fn version_string(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100)
}

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [u8; 128],
}

/// `ncclDevCommRequirements` of NCCL 2.28 (the version check guarantees the
/// layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct DevCommRequirements {
    pub resource_requirements: usize,
    pub team_requirements: usize,
    pub lsa_multimem: bool,
    pub barrier_count: c_int,
    pub lsa_barrier_count: c_int,
    pub rail_gin_barrier_count: c_int,
    pub lsa_ll_a2a_block_count: c_int,
    pub lsa_ll_a2a_slot_count: c_int,
    pub gin_force_enable: bool,
    pub gin_context_count: c_int,
    pub gin_signal_count: c_int,
    pub gin_counter_count: c_int,
}

/// Bytes reserved for an `ncclDevComm` (NCCL 2.28.9's is 200); one
/// definition with the kernels (src/abi/defs.rs), where
/// `kernels/include/ep_net.cuh` checks the real size against it.
pub(crate) use crate::abi::NCCL_DEV_COMM_BYTES as DEV_COMM_BYTES;

/// An `ncclDevComm`, as NCCL writes it: opaque but for its first fields,
/// which say where this rank sits (stable in the 2.28 series).
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub struct DevComm {
    pub bytes: [u8; DEV_COMM_BYTES],
}

impl DevComm {
    pub fn zeroed() -> DevComm {
        DevComm {
            bytes: [0; DEV_COMM_BYTES],
        }
    }

    fn int_at(&self, offset: usize) -> i32 {
        i32::from_ne_bytes(self.bytes[offset..offset + 4].try_into().unwrap())
    }

    /// This rank's index in its LSA team (the ranks it reaches over NVLink).
    pub fn lsa_rank(&self) -> usize {
        self.int_at(12) as usize
    }

    /// Ranks in this rank's LSA team, consecutive world ranks.
    pub fn lsa_size(&self) -> usize {
        self.int_at(16) as usize
    }
}

type FnVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type FnErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type FnLastError = unsafe extern "C" fn(Comm) -> *const c_char;
type FnCommInt = unsafe extern "C" fn(Comm, *mut c_int) -> NcclResult;
type FnMemAlloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> NcclResult;
type FnMemFree = unsafe extern "C" fn(*mut c_void) -> NcclResult;
type FnWindowRegister =
    unsafe extern "C" fn(Comm, *mut c_void, usize, *mut Window, c_int) -> NcclResult;
type FnWindowDeregister = unsafe extern "C" fn(Comm, Window) -> NcclResult;
type FnDevCommCreate =
    unsafe extern "C" fn(Comm, *const DevCommRequirements, *mut DevComm) -> NcclResult;
type FnDevCommDestroy = unsafe extern "C" fn(Comm, *const DevComm) -> NcclResult;
type FnAllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> NcclResult;
type FnGetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type FnCommInitRank = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> NcclResult;
type FnCommDestroy = unsafe extern "C" fn(Comm) -> NcclResult;
type FnTeam = unsafe extern "C" fn(Comm) -> Team;

/// `ncclTeam_t`: `ranks` ranks, this one at `rank`, world ranks `stride`
/// apart.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Team {
    pub ranks: c_int,
    pub rank: c_int,
    pub stride: c_int,
}

/// The loaded library and the entry points ep uses.
pub struct Nccl {
    /// Where the library was loaded from (for messages).
    pub path: String,
    pub version: i32,
    error_string: FnErrorString,
    last_error: FnLastError,
    comm_count: FnCommInt,
    comm_user_rank: FnCommInt,
    comm_cu_device: FnCommInt,
    mem_alloc: FnMemAlloc,
    mem_free: FnMemFree,
    window_register: FnWindowRegister,
    window_deregister: FnWindowDeregister,
    dev_comm_create: FnDevCommCreate,
    dev_comm_destroy: FnDevCommDestroy,
    all_gather: FnAllGather,
    get_unique_id: FnGetUniqueId,
    comm_init_rank: FnCommInitRank,
    comm_destroy: FnCommDestroy,
    team_lsa: FnTeam,
}

static NCCL: OnceCell<Result<Nccl>> = OnceCell::new();

/// The process's NCCL, loaded and version-checked once.
///
/// Errors: `Unsupported` when no NCCL can be loaded, an entry point is
/// missing, or its version differs from [`BUILT_VERSION`].
pub fn load() -> Result<&'static Nccl> {
    NCCL.get_or_init(open).as_ref().map_err(Clone::clone)
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: checked above.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}

/// The library handle: the loaded copy, `EP_NCCL_LIBRARY`, or
/// `libnccl.so.2`.
fn open_library() -> Result<*mut c_void> {
    let soname = c"libnccl.so.2";
    // SAFETY: dlopen with a NUL-terminated name; NOLOAD only looks.
    let loaded = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if !loaded.is_null() {
        return Ok(loaded);
    }
    let (name, what) = match std::env::var("EP_NCCL_LIBRARY") {
        Ok(path) if !path.is_empty() => (path.clone(), format!("EP_NCCL_LIBRARY={path}")),
        _ => ("libnccl.so.2".to_string(), "libnccl.so.2".to_string()),
    };
    let c_name = CString::new(name).map_err(|_| Error::invalid("EP_NCCL_LIBRARY holds a NUL"))?;
    // SAFETY: as above; the library stays loaded for the process.
    let lib = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        return Err(Error::unsupported(format!(
            "NCCL is not available: no libnccl.so.2 is loaded in this process and {what} could not be opened ({}); install NCCL {} (pip install nvidia-nccl-cu13=={}) and load it or name it in EP_NCCL_LIBRARY",
            dlerror_text(),
            version_string(BUILT_VERSION),
            version_string(BUILT_VERSION),
        )));
    }
    Ok(lib)
}

/// Resolves `name` in `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the function type of the symbol.
unsafe fn symbol<T: Copy>(lib: *mut c_void, name: &str) -> Result<T> {
    let c_name = CString::new(name).expect("symbol names have no NUL");
    let ptr = libc::dlsym(lib, c_name.as_ptr());
    if ptr.is_null() {
        return Err(Error::unsupported(format!(
            "the loaded NCCL has no {name} (NCCL {} or later is needed)",
            version_string(BUILT_VERSION)
        )));
    }
    Ok(std::mem::transmute_copy::<*mut c_void, T>(&ptr))
}

/// The file a symbol of `lib` comes from.
fn library_path(lib: *mut c_void) -> String {
    // SAFETY: dlsym on a live handle; dladdr writes into `info`.
    unsafe {
        let sym = libc::dlsym(lib, c"ncclGetVersion".as_ptr());
        let mut info: libc::Dl_info = std::mem::zeroed();
        if !sym.is_null() && libc::dladdr(sym, &mut info) != 0 && !info.dli_fname.is_null() {
            return CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned();
        }
    }
    "libnccl.so.2".to_string()
}

/// The message for an NCCL whose version is not the one the kernels were
/// built for.
pub fn version_mismatch(found: i32, path: &str) -> String {
    let mut message = format!(
        "{path} is NCCL {}, but ep's network kernels were compiled against NCCL {} (nvidia-nccl-cu13=={}), and NCCL's device API is not compatible across versions: load NCCL {} (before ep, or name it in EP_NCCL_LIBRARY)",
        version_string(found),
        version_string(BUILT_VERSION),
        version_string(BUILT_VERSION),
        version_string(BUILT_VERSION),
    );
    if found < BUILT_VERSION {
        message.push_str(
            "; older NCCLs also refuse symmetric memory on some communicators (NCCL 2.28.3 on a 1-rank communicator: \"Communicator does not support symmetric memory\")",
        );
    }
    message
}

fn open() -> Result<Nccl> {
    let lib = open_library()?;
    let path = library_path(lib);
    // SAFETY: every symbol gets the type of its declaration in nccl.h.
    unsafe {
        let get_version: FnVersion = symbol(lib, "ncclGetVersion")?;
        let mut version = 0;
        if get_version(&mut version) != NCCL_SUCCESS {
            return Err(Error::unsupported(format!("{path}: ncclGetVersion failed")));
        }
        if version != BUILT_VERSION {
            return Err(Error::unsupported(version_mismatch(version, &path)));
        }
        Ok(Nccl {
            path,
            version,
            error_string: symbol(lib, "ncclGetErrorString")?,
            last_error: symbol(lib, "ncclGetLastError")?,
            comm_count: symbol(lib, "ncclCommCount")?,
            comm_user_rank: symbol(lib, "ncclCommUserRank")?,
            comm_cu_device: symbol(lib, "ncclCommCuDevice")?,
            mem_alloc: symbol(lib, "ncclMemAlloc")?,
            mem_free: symbol(lib, "ncclMemFree")?,
            window_register: symbol(lib, "ncclCommWindowRegister")?,
            window_deregister: symbol(lib, "ncclCommWindowDeregister")?,
            dev_comm_create: symbol(lib, "ncclDevCommCreate")?,
            dev_comm_destroy: symbol(lib, "ncclDevCommDestroy")?,
            all_gather: symbol(lib, "ncclAllGather")?,
            get_unique_id: symbol(lib, "ncclGetUniqueId")?,
            comm_init_rank: symbol(lib, "ncclCommInitRank")?,
            comm_destroy: symbol(lib, "ncclCommDestroy")?,
            team_lsa: symbol(lib, "ncclTeamLsa")?,
        })
    }
}

impl Nccl {
    /// `Ok` for `ncclSuccess`, else an error naming `what`, NCCL's name of
    /// the result and, with a communicator, NCCL's last error message.
    fn check(&self, result: NcclResult, what: &str, comm: Comm) -> Result<()> {
        if result == NCCL_SUCCESS {
            return Ok(());
        }
        // SAFETY: both return static or communicator-owned C strings.
        let name = unsafe { CStr::from_ptr((self.error_string)(result)) }.to_string_lossy();
        let last = if comm.is_null() {
            String::new()
        } else {
            // SAFETY: as above.
            let text = unsafe { (self.last_error)(comm) };
            if text.is_null() {
                String::new()
            } else {
                // SAFETY: checked above.
                let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
                if text.is_empty() {
                    String::new()
                } else {
                    format!(": {text}")
                }
            }
        };
        let kind = if result == 7 {
            ErrorKind::InProgress
        } else {
            ErrorKind::Remote
        };
        Err(Error::new(
            kind,
            format!(
                "{what} failed: {name} (NCCL {}){last}",
                version_string(self.version)
            ),
        ))
    }

    /// Rank count, this rank and its CUDA device of `comm`.
    ///
    /// # Safety
    /// `comm` must be a live communicator of this library.
    pub unsafe fn comm_info(&self, comm: Comm) -> Result<(usize, usize, i32)> {
        let (mut count, mut rank, mut device) = (0, 0, 0);
        self.check((self.comm_count)(comm, &mut count), "ncclCommCount", comm)?;
        self.check(
            (self.comm_user_rank)(comm, &mut rank),
            "ncclCommUserRank",
            comm,
        )?;
        self.check(
            (self.comm_cu_device)(comm, &mut device),
            "ncclCommCuDevice",
            comm,
        )?;
        if count < 1 || rank < 0 || rank >= count || device < 0 {
            return Err(Error::invalid(format!(
                "the communicator reports rank {rank} of {count} on device {device}"
            )));
        }
        Ok((count as usize, rank as usize, device))
    }

    /// `ncclTeamLsa`: the ranks this rank reaches by loads and stores.
    ///
    /// # Safety
    /// `comm` must be a live communicator of this library.
    pub unsafe fn team_lsa(&self, comm: Comm) -> Team {
        (self.team_lsa)(comm)
    }

    /// `ncclMemAlloc`: `bytes` of device memory NCCL can register as a
    /// symmetric window. The device's context must be current.
    pub fn mem_alloc(&self, bytes: usize) -> Result<u64> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        let result = unsafe { (self.mem_alloc)(&mut ptr, bytes) };
        self.check(result, "ncclMemAlloc", std::ptr::null_mut())
            .map_err(|e| Error::new(ErrorKind::OutOfMemory, e.message))?;
        Ok(ptr as u64)
    }

    /// `ncclMemFree` of an `ncclMemAlloc` pointer.
    ///
    /// # Safety
    /// `ptr` came from [`Nccl::mem_alloc`] and is no longer used.
    pub unsafe fn mem_free(&self, ptr: u64) {
        (self.mem_free)(ptr as *mut c_void);
    }

    /// `ncclCommWindowRegister` (collective): the window over `[ptr, ptr +
    /// bytes)`.
    ///
    /// # Safety
    /// `comm` is live; the memory is `ncclMemAlloc`'d and outlives the window.
    pub unsafe fn window_register(&self, comm: Comm, ptr: u64, bytes: usize) -> Result<Window> {
        let mut window = std::ptr::null_mut();
        self.check(
            (self.window_register)(
                comm,
                ptr as *mut c_void,
                bytes,
                &mut window,
                WIN_COLL_SYMMETRIC,
            ),
            "ncclCommWindowRegister",
            comm,
        )?;
        Ok(window)
    }

    /// `ncclCommWindowDeregister`; the result is ignored (called on drop).
    ///
    /// # Safety
    /// The window belongs to `comm` and no kernel uses it any more.
    pub unsafe fn window_deregister(&self, comm: Comm, window: Window) {
        (self.window_deregister)(comm, window);
    }

    /// `ncclDevCommCreate` with `requirements`.
    ///
    /// # Safety
    /// `comm` is live.
    pub unsafe fn dev_comm_create(
        &self,
        comm: Comm,
        requirements: &DevCommRequirements,
    ) -> Result<DevComm> {
        let mut dev = DevComm::zeroed();
        self.check(
            (self.dev_comm_create)(comm, requirements, &mut dev),
            "ncclDevCommCreate",
            comm,
        )?;
        Ok(dev)
    }

    /// `ncclDevCommDestroy`; the result is ignored (called on drop).
    ///
    /// # Safety
    /// `dev` came from [`Nccl::dev_comm_create`] on `comm`.
    pub unsafe fn dev_comm_destroy(&self, comm: Comm, dev: &DevComm) {
        (self.dev_comm_destroy)(comm, dev);
    }

    /// Enqueues `ncclAllGather` of `bytes` bytes per rank on `stream`.
    ///
    /// # Safety
    /// Device buffers of `bytes` and `bytes * world` bytes; `comm` is live.
    pub unsafe fn all_gather(
        &self,
        comm: Comm,
        send: u64,
        recv: u64,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        self.check(
            (self.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                bytes,
                NCCL_UINT8,
                comm,
                stream,
            ),
            "ncclAllGather",
            comm,
        )
    }

    /// `ncclGetUniqueId`.
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes one id.
        let result = unsafe { (self.get_unique_id)(&mut id) };
        self.check(result, "ncclGetUniqueId", std::ptr::null_mut())?;
        Ok(id)
    }

    /// `ncclCommInitRank` (collective, blocking). The device's context must
    /// be current.
    pub fn comm_init_rank(&self, world: usize, id: UniqueId, rank: usize) -> Result<Comm> {
        let mut comm = std::ptr::null_mut();
        // SAFETY: writes one communicator.
        let result = unsafe { (self.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) };
        self.check(result, "ncclCommInitRank", std::ptr::null_mut())?;
        Ok(comm)
    }

    /// `ncclCommDestroy`; the result is ignored (called on drop).
    ///
    /// # Safety
    /// `comm` came from [`Nccl::comm_init_rank`] and is used no more.
    pub unsafe fn comm_destroy(&self, comm: Comm) {
        (self.comm_destroy)(comm);
    }
}

/// An NCCL communicator a context uses: the caller's, borrowed (never
/// destroyed here), or the context's own, destroyed when the last user of
/// this handle is dropped.
pub struct CommHandle {
    pub nccl: &'static Nccl,
    pub comm: Comm,
    pub owned: bool,
}

// SAFETY: a communicator handle is a plain value; the context's calls on it
// are made by one thread at a time.
unsafe impl Send for CommHandle {}
unsafe impl Sync for CommHandle {}

impl Drop for CommHandle {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: our own communicator; every window and device
            // communicator of it is gone (they hold this handle).
            unsafe { self.nccl.comm_destroy(self.comm) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_print_as_nccl_does() {
        assert_eq!(version_string(22809), "2.28.9");
        assert_eq!(version_string(22803), "2.28.3");
        assert_eq!(BUILT_VERSION / 10000, 2, "built against NCCL 2.x");
    }

    #[test]
    fn an_older_nccl_is_refused_naming_both_versions_and_the_symmetric_memory_limit() {
        let message = version_mismatch(22803, "/usr/lib/x86_64-linux-gnu/libnccl.so.2");
        let built = version_string(BUILT_VERSION);
        assert!(message.contains("/usr/lib/x86_64-linux-gnu/libnccl.so.2 is NCCL 2.28.3"));
        assert!(message.contains(&format!("compiled against NCCL {built}")));
        assert!(message.contains("Communicator does not support symmetric memory"));
        let newer = version_mismatch(BUILT_VERSION + 100, "libnccl.so.2");
        assert!(!newer.contains("symmetric memory on"));
    }

    #[test]
    fn requirements_have_the_layout_of_nccl_2_28() {
        assert_eq!(std::mem::size_of::<DevCommRequirements>(), 56);
        assert_eq!(std::mem::offset_of!(DevCommRequirements, barrier_count), 20);
        assert_eq!(
            std::mem::offset_of!(DevCommRequirements, gin_force_enable),
            40
        );
        assert_eq!(
            std::mem::offset_of!(DevCommRequirements, gin_signal_count),
            48
        );
    }
}
