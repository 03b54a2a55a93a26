//! A small wrapper over the CUDA driver API (cudarc's raw `sys` bindings).
//!
//! The library links no CUDA library: `libcuda.so.1` is opened at run time
//! (cudarc's `dynamic-loading`), and the kernels, compiled by `build.rs` into
//! one fatbin per kernel file, are embedded in the library and loaded with
//! `cuModuleLoadData`. A machine without an NVIDIA driver gets
//! [`ErrorKind::CudaUnavailable`] from the first call, never a panic.
//!
//! Contexts: everything here runs in the device's *primary* context, the one
//! the CUDA runtime (and so PyTorch) uses too. It is retained, never created
//! or destroyed, and made current only for the duration of a call (pushed,
//! then popped), so the caller's current context is the same after every
//! call as before. Each wrapper that needs a context binds it itself; use
//! [`Device::bind`] only around raw `sys` calls of your own.
//!
//! Asynchronous operations take a `CUstream` owned by the caller; the null
//! stream is allowed.

use std::ffi::{c_void, CStr};
use std::marker::PhantomData;
use std::mem::size_of;
use std::ptr;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;
pub use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUresult, CUstream};
use once_cell::sync::OnceCell;

use super::sequence::Collective;
use crate::abi::{self, TmaDescriptor};
use crate::error::{Error, ErrorKind, Result};

/// Aligns an embedded fatbin: the driver reads its headers as 8-byte
/// structures (nvcc and clang align their embedded fatbins to 8 as well),
/// while `include_bytes!` alone guarantees an alignment of 1.
#[repr(C, align(8))]
pub struct Aligned<T: ?Sized>(pub T);

// `KERNEL_IMAGES`: (file name, fatbin) of every `kernels/*.cu`, as
// `build.rs` compiled it: SASS for each target architecture plus PTX.
include!(concat!(env!("OUT_DIR"), "/ep_kernels.rs"));

/// The handle `CU_STREAM_LEGACY` of cuda.h: the legacy default stream, as
/// NULL is (not in the driver's bindings, which omit the macro).
pub const STREAM_LEGACY: usize = 0x1;

/// The handle `CU_STREAM_PER_THREAD` of cuda.h: the calling thread's
/// default stream.
pub const STREAM_PER_THREAD: usize = 0x2;

/// The first four bytes of every fatbin, read as a little-endian `u32`.
pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;

// ---------------------------------------------------------------------------
// Driver loading and errors
// ---------------------------------------------------------------------------

/// The outcome of loading libcuda and `cuInit`, decided once per process:
/// neither a missing driver nor a failed `cuInit` gets better by retrying.
static DRIVER: OnceCell<Result<()>> = OnceCell::new();

/// Loads the driver library and initializes it (once; later calls return the
/// first outcome). Every other function here calls it first.
///
/// Errors: `CudaUnavailable` when there is no `libcuda.so.1` or no device;
/// `Cuda` when `cuInit` fails otherwise.
pub fn init() -> Result<()> {
    DRIVER.get_or_init(load_driver).clone()
}

fn load_driver() -> Result<()> {
    // cudarc panics on its first call into a driver it cannot load, so look
    // for the library first. catch_unwind is a second guard: a panic here
    // must become an error, not unwind into a C caller.
    let present = std::panic::catch_unwind(|| {
        // SAFETY: only tries to dlopen the library names cudarc knows.
        unsafe { sys::is_culib_present() }
    })
    .unwrap_or(false);
    if !present {
        return Err(Error::new(
            ErrorKind::CudaUnavailable,
            "libcuda.so.1 not found: no NVIDIA driver on this machine",
        ));
    }
    // SAFETY: cuInit takes no pointers; 0 is the only valid flag value.
    let res = std::panic::catch_unwind(|| unsafe { sys::cuInit(0) }).map_err(|_| {
        Error::new(
            ErrorKind::CudaUnavailable,
            "the CUDA driver library could not be loaded (cuInit missing)",
        )
    })?;
    if res == CUresult::CUDA_ERROR_NO_DEVICE {
        return Err(no_device());
    }
    check(res, "cuInit")
}

fn no_device() -> Error {
    Error::new(ErrorKind::CudaUnavailable, "no CUDA device")
}

/// Turns a driver result into a `Result`: `CUDA_SUCCESS` is `Ok`,
/// `CUDA_ERROR_OUT_OF_MEMORY` is `OutOfMemory`, anything else is `Cuda`.
/// The message names the call (`what`) and the error, e.g.
/// `cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (out of memory)`.
pub fn check(res: CUresult, what: &str) -> Result<()> {
    if res == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let kind = if res == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        ErrorKind::OutOfMemory
    } else {
        ErrorKind::Cuda
    };
    Err(Error::new(kind, format!("{what}: {}", describe(res))))
}

/// The error's name and description from the driver (`cuGetErrorName`,
/// `cuGetErrorString`). Without a loaded driver, cudarc's name of the code,
/// which is the same name, spelled by the Rust enum.
fn describe(res: CUresult) -> String {
    if !matches!(DRIVER.get(), Some(Ok(()))) {
        return format!("{res:?}");
    }
    let mut name: *const libc::c_char = ptr::null();
    let mut text: *const libc::c_char = ptr::null();
    // SAFETY: both write a pointer to a static string, or fail and leave
    // the pointer null.
    let (name_res, text_res) = unsafe {
        (
            sys::cuGetErrorName(res, &mut name),
            sys::cuGetErrorString(res, &mut text),
        )
    };
    // SAFETY: on success the pointers are static NUL-terminated strings.
    let to_string = |p: *const libc::c_char| unsafe { CStr::from_ptr(p) }.to_string_lossy();
    match (name_res, text_res) {
        (CUresult::CUDA_SUCCESS, CUresult::CUDA_SUCCESS) if !name.is_null() && !text.is_null() => {
            format!("{} ({})", to_string(name), to_string(text))
        }
        _ => format!("{res:?}"),
    }
}

/// How many CUDA devices this process sees.
///
/// Errors: `CudaUnavailable` with "no CUDA device" when it sees none.
pub fn device_count() -> Result<usize> {
    init()?;
    let mut count = 0;
    // SAFETY: writes one int.
    check(
        unsafe { sys::cuDeviceGetCount(&mut count) },
        "cuDeviceGetCount",
    )?;
    if count <= 0 {
        return Err(no_device());
    }
    Ok(count as usize)
}

// ---------------------------------------------------------------------------
// Device and context
// ---------------------------------------------------------------------------

/// One GPU and its retained primary context. Cheap to clone (shared
/// handle); the context is released when the last clone, and every buffer
/// and module made from it, is gone.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    ordinal: usize,
    handle: sys::CUdevice,
    context: sys::CUcontext,
}

// SAFETY: the driver API is thread-safe, and a context handle may be made
// current on any thread; the handle itself is never mutated.
unsafe impl Send for DeviceInner {}
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: balances the cuDevicePrimaryCtxRetain of Device::new. The
        // result is ignored: a destructor cannot report it, and a failure
        // leaves at worst a context alive until the process exits.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.handle) };
    }
}

impl Device {
    /// Opens device `ordinal` (0-based, as CUDA numbers the devices this
    /// process sees) and retains its primary context.
    ///
    /// Errors: `CudaUnavailable` without driver or device;
    /// `InvalidArgument` when `ordinal` is not below the device count.
    pub fn new(ordinal: usize) -> Result<Device> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::invalid(format!(
                "CUDA device {ordinal} does not exist: this process sees {count} device(s)"
            )));
        }
        let mut handle = 0;
        // SAFETY: ordinal < count fits in an int; writes one CUdevice.
        check(
            unsafe { sys::cuDeviceGet(&mut handle, ordinal as i32) },
            "cuDeviceGet",
        )?;
        let mut context = ptr::null_mut();
        // SAFETY: writes one context handle; balanced in DeviceInner::drop.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, handle) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(Device {
            inner: Arc::new(DeviceInner {
                ordinal,
                handle,
                context,
            }),
        })
    }

    /// The ordinal this device was opened with.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device's primary context (retained while this handle lives).
    pub fn context(&self) -> sys::CUcontext {
        self.inner.context
    }

    /// The driver's handle of the device.
    pub fn handle(&self) -> sys::CUdevice {
        self.inner.handle
    }

    /// The device's primary context, where everything here runs.
    pub fn primary_context(&self) -> sys::CUcontext {
        self.inner.context
    }

    /// Makes the primary context current on this thread until the guard is
    /// dropped, which restores whatever was current before (or nothing).
    pub fn bind(&self) -> Result<ContextGuard<'_>> {
        // SAFETY: the context is retained for as long as `self` lives, and
        // the guard borrows `self`.
        check(
            unsafe { sys::cuCtxPushCurrent_v2(self.inner.context) },
            "cuCtxPushCurrent",
        )?;
        Ok(ContextGuard {
            _device: PhantomData,
            _not_send: PhantomData,
        })
    }

    /// One of the device's attributes (`cuDeviceGetAttribute`).
    pub fn attribute(&self, attribute: CUdevice_attribute) -> Result<i32> {
        let mut value = 0;
        // SAFETY: writes one int.
        check(
            unsafe { sys::cuDeviceGetAttribute(&mut value, attribute, self.inner.handle) },
            "cuDeviceGetAttribute",
        )?;
        Ok(value)
    }

    /// The number of streaming multiprocessors.
    pub fn sm_count(&self) -> Result<u32> {
        let count = self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(count as u32)
    }

    /// The GPU's UUID, the same in every process that sees the GPU (and
    /// distinct for every GPU and MIG instance).
    pub fn uuid(&self) -> Result<[u8; 16]> {
        // SAFETY: an all-zero CUuuid is a valid value to overwrite.
        let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
        // SAFETY: writes one CUuuid.
        check(
            unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, self.inner.handle) },
            "cuDeviceGetUuid",
        )?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String> {
        let mut buf = [0 as libc::c_char; 256];
        // SAFETY: writes at most `buf.len()` bytes, NUL-terminated.
        check(
            unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.inner.handle) },
            "cuDeviceGetName",
        )?;
        // SAFETY: NUL-terminated within `buf` (the driver truncates).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// The compute capability, e.g. (9, 0).
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        Ok((
            self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// Whether all work queued on `stream` has finished (without waiting);
    /// an error when some of it failed.
    ///
    /// # Safety
    /// As [`Device::stream_synchronize`].
    pub unsafe fn stream_done(&self, stream: CUstream) -> Result<bool> {
        let _context = self.bind()?;
        // SAFETY: the caller vouches for the stream.
        match unsafe { sys::cuStreamQuery(stream) } {
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            res => check(res, "cuStreamQuery").map(|()| true),
        }
    }

    /// Waits until all work queued on `stream` has finished.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device, or null for the
    /// device's default stream.
    pub unsafe fn stream_synchronize(&self, stream: CUstream) -> Result<()> {
        let _context = self.bind()?;
        // SAFETY: the caller vouches for the stream.
        check(
            unsafe { sys::cuStreamSynchronize(stream) },
            "cuStreamSynchronize",
        )
    }
}

/// Keeps a device's primary context current on this thread; dropping it pops
/// the context again. Not `Send`: a context is pushed on, and must be popped
/// from, one thread's context stack.
pub struct ContextGuard<'a> {
    _device: PhantomData<&'a Device>,
    _not_send: PhantomData<*const ()>,
}

impl Drop for ContextGuard<'_> {
    fn drop(&mut self) {
        let mut popped = ptr::null_mut();
        // SAFETY: pops the context Device::bind pushed on this thread;
        // guards drop in reverse order of creation, so it is on top.
        unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

/// The library's kernels, loaded into a device's primary context: one
/// driver module per kernel file.
pub struct Module {
    device: Device,
    handles: Vec<sys::CUmodule>,
}

// SAFETY: a module handle belongs to a context, not to a thread, and is
// never mutated here.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    /// Loads every image of [`KERNEL_IMAGES`] on `device`.
    ///
    /// Errors: `Cuda` with `CUDA_ERROR_NO_BINARY_FOR_GPU` when an image
    /// holds no code this GPU can run (see `EP_CUDA_ARCHS` in build.rs).
    pub fn load(device: &Device) -> Result<Module> {
        let _context = device.bind()?;
        // Owned from the start, so an error unloads what was loaded.
        let mut module = Module {
            device: device.clone(),
            handles: Vec::with_capacity(KERNEL_IMAGES.len()),
        };
        for (name, image) in KERNEL_IMAGES {
            let mut handle = ptr::null_mut();
            // SAFETY: the image is a complete fatbin made by nvcc, 8-byte
            // aligned, and static.
            check(
                unsafe { sys::cuModuleLoadData(&mut handle, image.0.as_ptr().cast()) },
                &format!("cuModuleLoadData(kernels/{name}.cu)"),
            )?;
            module.handles.push(handle);
        }
        Ok(module)
    }

    /// The names of the loaded kernels, sorted (for the log).
    pub fn kernel_names(&self) -> Result<Vec<String>> {
        let _context = self.device.bind()?;
        let mut names = Vec::new();
        for &module in &self.handles {
            let mut count = 0u32;
            // SAFETY: writes one count.
            check(
                unsafe { sys::cuModuleGetFunctionCount(&mut count, module) },
                "cuModuleGetFunctionCount",
            )?;
            let mut functions = vec![ptr::null_mut(); count as usize];
            // SAFETY: `functions` has room for `count` handles.
            check(
                unsafe { sys::cuModuleEnumerateFunctions(functions.as_mut_ptr(), count, module) },
                "cuModuleEnumerateFunctions",
            )?;
            for f in functions {
                let mut name: *const libc::c_char = ptr::null();
                // SAFETY: writes a pointer to the function's static name.
                check(unsafe { sys::cuFuncGetName(&mut name, f) }, "cuFuncGetName")?;
                if !name.is_null() {
                    // SAFETY: a NUL-terminated string owned by the module.
                    names.push(
                        unsafe { CStr::from_ptr(name) }
                            .to_string_lossy()
                            .into_owned(),
                    );
                }
            }
        }
        names.sort();
        Ok(names)
    }

    /// The kernel called `name` (its `extern "C"` name), which takes one
    /// parameter of type `P`: looked up and loaded onto the device once,
    /// when the kernels are loaded (once per device), not at every launch.
    ///
    /// Errors: `Cuda` with `CUDA_ERROR_NOT_FOUND` when there is none.
    pub fn function<P>(&self, name: &'static CStr) -> Result<Kernel<P>> {
        let _context = self.device.bind()?;
        for &module in &self.handles {
            let mut handle = ptr::null_mut();
            // SAFETY: the module is loaded, the name NUL-terminated.
            let res = unsafe { sys::cuModuleGetFunction(&mut handle, module, name.as_ptr()) };
            if res == CUresult::CUDA_ERROR_NOT_FOUND {
                continue;
            }
            check(
                res,
                &format!("cuModuleGetFunction({})", name.to_string_lossy()),
            )?;
            // Loaded now, not at its first launch: with lazy loading (the
            // driver's default) a first launch waits for the whole device,
            // and where ranks share a GPU that includes a peer's kernel
            // waiting for this very launch.
            // SAFETY: a function handle of a loaded module.
            check(
                unsafe { sys::cuFuncLoad(handle) },
                &format!("cuFuncLoad({})", name.to_string_lossy()),
            )?;
            return Ok(Kernel {
                handle,
                name,
                params: PhantomData,
            });
        }
        Err(Error::new(
            ErrorKind::Cuda,
            format!(
                "cuModuleGetFunction({}): no kernel of that name in any kernel file",
                name.to_string_lossy()
            ),
        ))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if let Ok(_context) = self.device.bind() {
            for &handle in &self.handles {
                // SAFETY: the kernels of a module are only launched while
                // it is loaded (their owners keep the module). The result
                // is ignored, as in every destructor here.
                unsafe { sys::cuModuleUnload(handle) };
            }
        }
    }
}

/// How a launch is ordered after the work ahead of it on its stream: two
/// independent launch attributes; the default is neither (plain stream
/// order, not cooperative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchOrder {
    /// Programmatic dependent launch: the grid's blocks may start while the
    /// kernel ahead still runs (once that kernel allows it, or as it ends).
    /// Only for ep kernels, each of which waits for the kernel ahead before
    /// touching memory (`ep_kernel_start`, kernels/include/ep_device.cuh).
    /// Without it, plain stream order: the grid starts once the work ahead
    /// has ended.
    pub programmatic: bool,
    /// The driver starts the grid only with every block resident at once,
    /// so blocks may wait for each other.
    pub cooperative: bool,
}

/// One kernel of a [`Module`], whose single parameter is a `P` (a struct of
/// `src/abi/defs.rs`), so a launch cannot pass the wrong struct. A plain
/// handle: valid while its module is loaded, which its owner guarantees.
pub struct Kernel<P> {
    handle: sys::CUfunction,
    name: &'static CStr,
    params: PhantomData<fn(&P)>,
}

// Not derived: `P` itself need not be `Clone`.
impl<P> Clone for Kernel<P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P> Copy for Kernel<P> {}

// SAFETY: a function handle is an immutable part of its module; launching
// it from several threads at once is allowed by the driver.
unsafe impl<P> Send for Kernel<P> {}
unsafe impl<P> Sync for Kernel<P> {}

impl<P> Kernel<P> {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        self.name.to_str().unwrap_or("kernel")
    }

    /// Queues the kernel on `stream` with a one-dimensional grid of `grid`
    /// blocks of `block` threads, `shared_bytes` of dynamic shared memory,
    /// and `params` as its parameter (the driver copies it during the call).
    /// `bound` is the caller's proof that the kernel's context is current
    /// on this thread: an API call binds its context once, then launches.
    ///
    /// Errors: `InvalidArgument` for an empty grid or block (nothing is
    /// queued); `Cuda` when the driver refuses the launch. Faults while the
    /// kernel runs surface at the next synchronization.
    ///
    /// # Safety
    /// The module must still be loaded, and every device pointer in
    /// `params` must stay valid until the kernel has finished.
    pub unsafe fn launch(
        &self,
        bound: &ContextGuard<'_>,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        stream: CUstream,
        params: &P,
    ) -> Result<()> {
        let order = LaunchOrder::default();
        // SAFETY: passed on from the caller.
        unsafe { self.launch_ex(bound, order, grid, block, shared_bytes, stream, params) }
    }

    /// Like [`Kernel::launch`] (`cuLaunchKernelEx`), in the given
    /// [`LaunchOrder`]. For a cooperative launch check
    /// [`Kernel::max_blocks_per_sm`] first.
    ///
    /// Errors: as `launch`, and for a cooperative launch `Unsupported` when
    /// the grid cannot be resident at once on this device (too many blocks
    /// for its SMs, or for the share of them that MPS or a green context
    /// leaves).
    ///
    /// # Safety
    /// As for `launch`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_ex(
        &self,
        _bound: &ContextGuard<'_>,
        order: LaunchOrder,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        stream: CUstream,
        params: &P,
    ) -> Result<()> {
        if grid == 0 || block == 0 {
            return Err(Error::invalid(format!(
                "{}: empty launch ({grid} blocks of {block} threads)",
                self.name()
            )));
        }
        // SAFETY: an all-zero attribute is valid; the union member written
        // is the one the attribute id names.
        let mut attributes: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        use sys::CUlaunchAttributeID_enum as Id;
        let mut count = 0;
        if order.programmatic {
            attributes[count].id = Id::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attributes[count]
                .value
                .programmaticStreamSerializationAllowed = 1;
            count += 1;
        }
        if order.cooperative {
            attributes[count].id = Id::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            attributes[count].value.cooperative = 1;
            count += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared_bytes,
            hStream: stream,
            attrs: attributes.as_mut_ptr(),
            numAttrs: count as u32,
        };
        let mut param = params as *const P as *mut c_void;
        // SAFETY: the caller vouches for the module, the pointers inside
        // `params` and the stream; the one parameter is a `P`.
        let res =
            unsafe { sys::cuLaunchKernelEx(&config, self.handle, &mut param, ptr::null_mut()) };
        match res {
            CUresult::CUDA_SUCCESS => Ok(()),
            CUresult::CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE => Err(Error::unsupported(format!(
                "{}: {grid} blocks of {block} threads cannot all be resident at once on this GPU \
                 (fewer SMs than expected: MPS or a green context may limit them)",
                self.name()
            ))),
            // The message is only made for a failure: launches are hot.
            _ => check(res, &format!("cuLaunchKernelEx({})", self.name())),
        }
    }

    /// Lets launches of this kernel ask for up to `bytes` of dynamic shared
    /// memory (above the default 48 KiB); `_bound` is the proof that the
    /// kernel's context is current.
    ///
    /// Errors: `Cuda` when the device has less.
    pub fn allow_dynamic_shared(&self, _bound: &ContextGuard<'_>, bytes: u32) -> Result<()> {
        // SAFETY: a function attribute of a loaded kernel.
        check(
            unsafe {
                sys::cuFuncSetAttribute(
                    self.handle,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            },
            &format!("cuFuncSetAttribute({})", self.name()),
        )
    }

    /// How many clusters of this kernel (compiled with its cluster shape)
    /// can be resident at once with blocks of `block` threads and
    /// `shared_bytes` of dynamic shared memory each; `cluster` is the
    /// cluster's size in blocks.
    ///
    /// Errors: `Cuda` when the driver cannot tell.
    pub fn max_active_clusters(
        &self,
        _bound: &ContextGuard<'_>,
        cluster: u32,
        block: u32,
        shared_bytes: u32,
    ) -> Result<u32> {
        let config = sys::CUlaunchConfig {
            gridDimX: cluster,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared_bytes,
            hStream: ptr::null_mut(),
            attrs: ptr::null_mut(),
            numAttrs: 0,
        };
        let mut clusters = 0;
        // SAFETY: a query on a loaded kernel with a complete configuration.
        check(
            unsafe { sys::cuOccupancyMaxActiveClusters(&mut clusters, self.handle, &config) },
            &format!("cuOccupancyMaxActiveClusters({})", self.name()),
        )?;
        Ok(clusters.max(0) as u32)
    }

    /// How many blocks of `block` threads with `shared_bytes` of dynamic
    /// shared memory fit on one SM at once
    /// (`cuOccupancyMaxActiveBlocksPerMultiprocessor`); 0 when none does.
    pub fn max_blocks_per_sm(
        &self,
        _bound: &ContextGuard<'_>,
        block: u32,
        shared_bytes: u32,
    ) -> Result<u32> {
        let mut blocks = 0;
        // SAFETY: writes one int; the function's context is current.
        check(
            unsafe {
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut blocks,
                    self.handle,
                    block as i32,
                    shared_bytes as usize,
                )
            },
            &format!(
                "cuOccupancyMaxActiveBlocksPerMultiprocessor({})",
                self.name()
            ),
        )?;
        Ok(blocks.max(0) as u32)
    }
}

// ---------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------

/// Types that may cross between host and device as raw bytes: plain data,
/// for which every bit pattern is a valid value.
///
/// # Safety
/// Implement only for types with no padding-dependent invariants, no
/// pointers or references, and no invalid bit patterns.
pub unsafe trait Plain: Copy {}

// SAFETY: integers and floats: every bit pattern is a value.
unsafe impl Plain for u8 {}
unsafe impl Plain for i32 {}
unsafe impl Plain for u32 {}
unsafe impl Plain for i64 {}
unsafe impl Plain for u64 {}
unsafe impl Plain for f32 {}

/// Device memory (`cuMemAlloc`), freed on drop.
pub struct DeviceBuffer {
    device: Device,
    ptr: CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on `device`, uninitialized. A zero-byte buffer
    /// allocates nothing and has the null pointer.
    ///
    /// Errors: `OutOfMemory` when the device has no room.
    pub fn new(device: &Device, len: usize) -> Result<DeviceBuffer> {
        let mut ptr = 0;
        if len > 0 {
            let _context = device.bind()?;
            // SAFETY: writes one device pointer; freed in drop.
            check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len) }, "cuMemAlloc")?;
        }
        Ok(DeviceBuffer {
            device: device.clone(),
            ptr,
            len,
        })
    }

    /// Allocates `len` bytes on `device` and fills them with zeros before
    /// returning (synchronises the device).
    ///
    /// Errors: `OutOfMemory` when the device has no room; `Cuda` when the
    /// fill fails.
    pub fn zeroed(device: &Device, len: usize) -> Result<DeviceBuffer> {
        let buffer = DeviceBuffer::new(device, len)?;
        if len > 0 {
            let _context = device.bind()?;
            // SAFETY: fills the allocation made above, then waits for it.
            unsafe {
                check(sys::cuMemsetD8_v2(buffer.ptr, 0, len), "cuMemsetD8")?;
                check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
            }
        }
        Ok(buffer)
    }

    /// Allocates a buffer holding a copy of `values`: the copy is
    /// synchronous (done when this returns).
    ///
    /// Errors: `OutOfMemory` when the device has no room; `Cuda` when the
    /// copy fails.
    pub fn from_host<T: Plain>(device: &Device, values: &[T]) -> Result<DeviceBuffer> {
        let buffer = DeviceBuffer::new(device, std::mem::size_of_val(values))?;
        // SAFETY: the buffer has the values' size, and the copy has run on
        // the null stream before `values` can change.
        unsafe {
            buffer.copy_from_host_async(values, ptr::null_mut())?;
            device.stream_synchronize(ptr::null_mut())?;
        }
        Ok(buffer)
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Queues a copy of `src` to the start of the buffer on `stream`.
    ///
    /// Errors: `InvalidArgument` when `src` is larger than the buffer.
    ///
    /// # Safety
    /// `src` must stay alive and unchanged, and the buffer alive, until the
    /// stream has executed the copy (e.g. until a stream synchronize).
    pub unsafe fn copy_from_host_async<T: Plain>(&self, src: &[T], stream: CUstream) -> Result<()> {
        let bytes = std::mem::size_of_val(src);
        self.check_fits(bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        let _context = self.device.bind()?;
        // SAFETY: bounds checked; lifetimes are the caller's promise.
        check(
            unsafe { sys::cuMemcpyHtoDAsync_v2(self.ptr, src.as_ptr().cast(), bytes, stream) },
            "cuMemcpyHtoDAsync",
        )
    }

    /// Queues a copy of the start of the buffer into `dst` on `stream`.
    ///
    /// Errors: `InvalidArgument` when `dst` is larger than the buffer.
    ///
    /// # Safety
    /// `dst` must stay alive and untouched, and the buffer alive, until the
    /// stream has executed the copy.
    pub unsafe fn copy_to_host_async<T: Plain>(
        &self,
        dst: &mut [T],
        stream: CUstream,
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(dst);
        self.check_fits(bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        let _context = self.device.bind()?;
        // SAFETY: bounds checked; T: Plain accepts any bytes the device has.
        check(
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), self.ptr, bytes, stream) },
            "cuMemcpyDtoHAsync",
        )
    }

    /// Queues setting every byte of the buffer to `value` on `stream`.
    ///
    /// # Safety
    /// The buffer must stay alive until the stream has executed the memset.
    pub unsafe fn memset_async(&self, value: u8, stream: CUstream) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let _context = self.device.bind()?;
        // SAFETY: the whole buffer, no more.
        check(
            unsafe { sys::cuMemsetD8Async(self.ptr, value, self.len, stream) },
            "cuMemsetD8Async",
        )
    }

    fn check_fits(&self, bytes: usize) -> Result<()> {
        if bytes > self.len {
            return Err(Error::invalid(format!(
                "copy of {bytes} bytes does not fit a device buffer of {} bytes",
                self.len
            )));
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if let Ok(_context) = self.device.bind() {
            // SAFETY: allocated by cuMemAlloc in new, freed once.
            unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// A stream of the library's own on a device, non-blocking (it never waits
/// for the legacy default stream), destroyed on drop.
pub struct OwnedStream {
    device: Device,
    stream: CUstream,
}

// SAFETY: a stream handle is not tied to a thread; its users serialise
// their work on it.
unsafe impl Send for OwnedStream {}
unsafe impl Sync for OwnedStream {}

impl OwnedStream {
    pub fn new(device: &Device) -> Result<OwnedStream> {
        let _context = device.bind()?;
        let mut stream = ptr::null_mut();
        // SAFETY: writes one stream handle; destroyed in drop.
        check(
            unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            },
            "cuStreamCreate",
        )?;
        Ok(OwnedStream {
            device: device.clone(),
            stream,
        })
    }

    pub fn raw(&self) -> CUstream {
        self.stream
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Waits for the work queued on this stream (only).
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream of this device.
        unsafe { self.device.stream_synchronize(self.stream) }
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        if let Ok(_context) = self.device.bind() {
            // SAFETY: created in new, destroyed once; its owner queues
            // nothing after its last wait.
            unsafe { sys::cuStreamDestroy_v2(self.stream) };
        }
    }
}

/// An event of the library's own (no timing), destroyed on drop: a point
/// of a stream's work that the host can wait for later.
pub struct Event {
    device: Device,
    event: sys::CUevent,
}

// SAFETY: an event handle is not tied to a thread; its users serialise
// their records and waits.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn new(device: &Device) -> Result<Event> {
        let _context = device.bind()?;
        let mut event = ptr::null_mut();
        // SAFETY: writes one event handle; destroyed in drop.
        check(
            unsafe {
                sys::cuEventCreate(
                    &mut event,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            },
            "cuEventCreate",
        )?;
        Ok(Event {
            device: device.clone(),
            event,
        })
    }

    /// Marks the work queued on `stream` so far.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device.
    pub unsafe fn record(&self, stream: CUstream) -> Result<()> {
        let _context = self.device.bind()?;
        // SAFETY: a live event; the caller vouches for the stream.
        check(
            unsafe { sys::cuEventRecord(self.event, stream) },
            "cuEventRecord",
        )
    }

    /// Waits until the work marked by the last record has run (at once if
    /// nothing was recorded).
    pub fn synchronize(&self) -> Result<()> {
        let _context = self.device.bind()?;
        // SAFETY: a live event.
        check(
            unsafe { sys::cuEventSynchronize(self.event) },
            "cuEventSynchronize",
        )
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_context) = self.device.bind() {
            // SAFETY: created in new, destroyed once.
            unsafe { sys::cuEventDestroy_v2(self.event) };
        }
    }
}

/// Pinned host memory that the device reads and writes directly
/// (`cuMemHostAlloc` with `DEVICEMAP | PORTABLE`): `len` values of `T`,
/// zeroed. For small words both sides poll while a kernel runs, such as
/// [`DeviceStatus`] and abort flags. The host side accesses it only with
/// volatile reads and writes, since the device changes it behind the
/// compiler's back.
pub struct MappedHost<T: Plain> {
    device: Device,
    host: *mut T,
    device_ptr: CUdeviceptr,
    len: usize,
}

// SAFETY: the memory is plain data reached only through volatile accesses
// of whole `Plain` values; pinned memory is not tied to a thread.
unsafe impl<T: Plain> Send for MappedHost<T> {}
unsafe impl<T: Plain> Sync for MappedHost<T> {}

impl<T: Plain> MappedHost<T> {
    /// Allocates `len` zeroed values of `T` (`len` >= 1).
    pub fn new(device: &Device, len: usize) -> Result<MappedHost<T>> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .filter(|&bytes| bytes > 0)
            .ok_or_else(|| Error::invalid(format!("mapped host buffer of {len} values")))?;
        let _context = device.bind()?;
        let mut host: *mut c_void = ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: writes one host pointer; freed in drop.
        check(
            unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) },
            "cuMemHostAlloc",
        )?;
        // Owned from here on, so an error below frees the allocation.
        let mut mapped: MappedHost<T> = MappedHost {
            device: device.clone(),
            host: host.cast(),
            device_ptr: 0,
            len,
        };
        // SAFETY: `bytes` bytes were just allocated, page-aligned.
        unsafe { ptr::write_bytes(mapped.host.cast::<u8>(), 0, bytes) };
        // SAFETY: the allocation is DEVICEMAP; flags must be 0.
        check(
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut mapped.device_ptr, host, 0) },
            "cuMemHostGetDevicePointer",
        )?;
        Ok(mapped)
    }

    /// The address for the host.
    pub fn host_ptr(&self) -> *mut T {
        self.host
    }

    /// The address for kernels on the device.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.device_ptr
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// False: `new` refuses zero values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Reads value `index` afresh from memory. Panics when out of range.
    pub fn read(&self, index: usize) -> T {
        assert!(index < self.len, "index {index} out of {}", self.len);
        // SAFETY: in bounds and aligned; T: Plain takes any bytes.
        unsafe { ptr::read_volatile(self.host.add(index)) }
    }

    /// Writes value `index` straight to memory. Panics when out of range.
    pub fn write(&self, index: usize, value: T) {
        assert!(index < self.len, "index {index} out of {}", self.len);
        // SAFETY: in bounds and aligned.
        unsafe { ptr::write_volatile(self.host.add(index), value) }
    }
}

impl MappedHost<i32> {
    /// Reads value `index` with acquire ordering: what the device wrote
    /// before its release store of that value is visible after it. Panics
    /// when out of range.
    pub fn load_acquire(&self, index: usize) -> i32 {
        assert!(index < self.len, "index {index} out of {}", self.len);
        // SAFETY: in bounds and aligned for an i32, which AtomicI32 shares;
        // the buffer lives as long as `self`, and every access to it is
        // volatile or atomic.
        unsafe { AtomicI32::from_ptr(self.host.add(index)) }.load(Ordering::Acquire)
    }
}

impl<T: Plain> Drop for MappedHost<T> {
    fn drop(&mut self) {
        if let Ok(_context) = self.device.bind() {
            // SAFETY: allocated by cuMemHostAlloc in new, freed once.
            unsafe { sys::cuMemFreeHost(self.host.cast()) };
        }
    }
}

// ---------------------------------------------------------------------------
// Tensor maps
// ---------------------------------------------------------------------------

/// Element types of [`tensor_map`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorElement {
    /// Two-byte bfloat16.
    Bf16,
    /// One byte (FP8 e4m3 is moved as bytes).
    Byte,
}

/// Most dimensions a tensor map may have (`cuTensorMapEncodeTiled`).
const MAX_TENSOR_RANK: usize = 5;

/// A TMA descriptor of the row-major tensor at `base` with extents `dims`
/// (innermost first), byte strides `strides` of dimensions 1.. , copied in
/// boxes of `boxes` elements into shared memory with the 128-byte swizzle
/// (the innermost box must span 128 bytes); reads outside the tensor give
/// zeros.
///
/// Errors: `InvalidArgument` when the driver refuses the shape (base or
/// strides not 16-byte aligned, extents out of range).
pub fn tensor_map(
    element: TensorElement,
    base: u64,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
) -> Result<TmaDescriptor> {
    init()?;
    assert!(dims.len() <= MAX_TENSOR_RANK);
    assert!(dims.len() == boxes.len() && strides.len() + 1 == dims.len());
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let data_type = match element {
        TensorElement::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        TensorElement::Byte => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
    };
    let element_strides = [1u32; MAX_TENSOR_RANK];
    // SAFETY: the arrays hold `dims.len()` (strides one fewer) values;
    // the driver only encodes, it reads no device memory.
    let res = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            dims.len() as u32,
            base as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if res != CUresult::CUDA_SUCCESS {
        return Err(Error::invalid(format!(
                "cuTensorMapEncodeTiled refused the tensor at {base:#x} (extents {dims:?}, strides {strides:?}, box {boxes:?}): {res:?}"
            )));
    }
    Ok(TmaDescriptor { opaque: map.opaque })
}

// ---------------------------------------------------------------------------
// What kernels report
// ---------------------------------------------------------------------------

pub use crate::abi::DeviceStatus;

// SAFETY: six ints, no padding; every bit pattern is a value.
unsafe impl Plain for DeviceStatus {}

/// The first error a rank's kernels hit (defined in src/abi/defs.rs). It
/// lives in a zeroed [`MappedHost`]; read it after the stream has
/// synchronized, when all fields have arrived.
impl DeviceStatus {
    /// `Ok` for code 0, otherwise the matching error: `Timeout`, `Aborted`,
    /// `InvalidArgument` (bad expert id, token count or launch argument), or `Internal`
    /// for a code this side does not know.
    pub fn to_result(&self) -> Result<()> {
        let phase = match self.phase {
            abi::PHASE_LAYOUT => "layout kernel",
            abi::PHASE_BARRIER => "barrier kernel",
            abi::PHASE_DISPATCH => "dispatch kernel",
            abi::PHASE_COMBINE => "combine kernel",
            abi::PHASE_LL_DISPATCH => "low-latency dispatch kernel",
            abi::PHASE_LL_COMBINE => "low-latency combine kernel",
            abi::PHASE_HIER_DISPATCH => "hierarchical dispatch kernel",
            abi::PHASE_HIER_COMBINE => "hierarchical combine kernel",
            abi::PHASE_HIER_BARRIER => "hierarchical barrier kernel",
            abi::PHASE_MOE_ACTIVATION => "MoE activation kernel",
            _ => "kernel",
        };
        let (kind, what) = match self.code {
            abi::STATUS_OK => return Ok(()),
            abi::STATUS_TIMEOUT => (
                ErrorKind::Timeout,
                format!(
                    "{}timed out waiting for rank {} to reach {} (last value seen {})",
                    self.in_call(),
                    self.rank,
                    self.awaited,
                    self.detail
                ),
            ),
            abi::STATUS_ABORTED => (
                ErrorKind::Aborted,
                format!(
                    "{}aborted while waiting for rank {} to reach {}",
                    self.in_call(),
                    self.rank,
                    self.awaited
                ),
            ),
            abi::STATUS_INVALID_EXPERT => (
                ErrorKind::InvalidArgument,
                format!(
                    "invalid expert id (out of range, or listed twice for one token) at topk_idx entry {} (token * topk + slot)",
                    self.detail
                ),
            ),
            abi::STATUS_INVALID_TOKEN_COUNT => (
                ErrorKind::InvalidArgument,
                format!(
                    "*device_num_tokens = {} is outside [0, num_tokens]; the call ran with no tokens",
                    self.detail
                ),
            ),
            abi::STATUS_INVALID_ARGUMENT => (
                ErrorKind::InvalidArgument,
                "launched with invalid arguments".to_string(),
            ),
            abi::STATUS_MISMATCH => (
                ErrorKind::Remote,
                format!(
                    "this rank is in {} but rank {} is in {}: the ranks' collective calls do not \
                     match (every rank must make the same calls in the same order)",
                    describe_call(self.call),
                    self.rank,
                    describe_call(self.detail)
                ),
            ),
            code => (
                ErrorKind::Internal,
                format!("unknown device status code {code}"),
            ),
        };
        Err(Error::new(kind, format!("{phase}: {what}")))
    }
}

impl DeviceStatus {
    /// "in <call>: " for a failed wait that knows its call, else "".
    fn in_call(&self) -> String {
        if self.call == 0 {
            String::new()
        } else {
            format!("in {}: ", describe_call(self.call))
        }
    }
}

/// A call word of the kernels (see `abi::CALL_NUMBER_BITS`) as
/// "ep_dispatch (collective call 7 on the device)"; the number is counted
/// modulo 2^CALL_NUMBER_BITS.
fn describe_call(word: i32) -> String {
    let number = word & ((1 << abi::CALL_NUMBER_BITS) - 1);
    let op = Collective::from_code((word >> abi::CALL_NUMBER_BITS) as u32);
    let name = op.map_or("an unknown operation", Collective::function);
    format!("{name} (collective call {number} on the device)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_driver_is_an_error_not_a_panic() {
        // SAFETY: only tries to dlopen libcuda.
        let present = unsafe { sys::is_culib_present() };
        match Device::new(0) {
            Ok(device) => assert!(present && device.ordinal() == 0),
            Err(err) if !present => {
                assert_eq!(err.kind, ErrorKind::CudaUnavailable);
                assert_eq!(
                    err.message,
                    "libcuda.so.1 not found: no NVIDIA driver on this machine"
                );
                // The outcome is remembered, not retried.
                assert_eq!(init(), Err(err));
            }
            // A driver without a GPU.
            Err(err) => assert_eq!(err, no_device()),
        }
    }

    /// The (kind, architecture) of each entry of a fatbin: kind 1 is PTX, 2
    /// machine code (ELF); the architecture is 90 for sm_90 and compute_90.
    /// The layout of the headers (a 16-byte file header, then per entry its
    /// kind at byte 0, header size at 4, payload size at 8 and architecture
    /// at 28) is what nvcc writes; the payloads are compressed
    /// (`-compress-mode=size`), so kernel names are not visible in them:
    /// every GPU context loads each kernel by name (`Kernels::load`).
    fn fatbin_entries(image: &[u8]) -> Vec<(u16, u32)> {
        let u16_at = |at: usize| u16::from_le_bytes(image[at..at + 2].try_into().unwrap());
        let u32_at = |at: usize| u32::from_le_bytes(image[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(image[at..at + 8].try_into().unwrap());
        let header = u16_at(6) as usize;
        let end = header + u64_at(8) as usize;
        assert!(end <= image.len());
        let mut entries = Vec::new();
        let mut at = header;
        while at < end {
            entries.push((u16_at(at), u32_at(at + 28)));
            at += u32_at(at + 4) as usize + u64_at(at + 8) as usize;
        }
        entries
    }

    #[test]
    fn embedded_fatbins_hold_sass_and_ptx_of_every_kernel_file() {
        assert_eq!(
            KERNEL_IMAGES.len(),
            std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels"))
                .unwrap()
                .filter(|e| e.as_ref().unwrap().path().extension() == Some("cu".as_ref()))
                .count()
        );
        for (name, image) in KERNEL_IMAGES {
            let image = &image.0[..];
            assert!(image.len() > 16);
            assert_eq!(image.as_ptr() as usize % 8, 0);
            let magic = u32::from_le_bytes(image[..4].try_into().unwrap());
            assert_eq!(magic, FATBIN_MAGIC);
            let entries = fatbin_entries(image);
            assert!(
                entries.contains(&(2, 90)),
                "{name}: no sm_90 code in {entries:?}"
            );
            assert!(
                entries.contains(&(1, 90)),
                "{name}: no compute_90 PTX in {entries:?}"
            );
        }
    }

    #[test]
    fn check_maps_result_codes() {
        assert_eq!(check(CUresult::CUDA_SUCCESS, "cuInit"), Ok(()));

        let oom = check(CUresult::CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc").unwrap_err();
        assert_eq!(oom.kind, ErrorKind::OutOfMemory);
        assert!(oom
            .message
            .starts_with("cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY"));

        let other = check(CUresult::CUDA_ERROR_INVALID_VALUE, "cuMemsetD8Async").unwrap_err();
        assert_eq!(other.kind, ErrorKind::Cuda);
        assert!(other
            .message
            .starts_with("cuMemsetD8Async: CUDA_ERROR_INVALID_VALUE"));
    }

    #[test]
    fn device_status_matches_the_c_struct_and_maps_codes() {
        assert_eq!(size_of::<DeviceStatus>(), 24);
        assert_eq!(DeviceStatus::default().to_result(), Ok(()));
        let status = |code, rank, phase, detail| DeviceStatus {
            code,
            rank,
            phase,
            detail,
            call: 0,
            awaited: 0,
        };
        let word = |op: i32, n: i32| op << abi::CALL_NUMBER_BITS | n;
        let timeout = DeviceStatus {
            call: word(2, 5),
            awaited: 7,
            ..status(abi::STATUS_TIMEOUT, 3, abi::PHASE_BARRIER, 6)
        };
        let err = timeout.to_result().unwrap_err();
        assert_eq!(err.kind, ErrorKind::Timeout);
        assert_eq!(
            err.message,
            "barrier kernel: in ep_combine (collective call 5 on the device): timed out waiting \
             for rank 3 to reach 7 (last value seen 6)"
        );
        let kind = |code| {
            status(code, -1, abi::PHASE_LAYOUT, 0)
                .to_result()
                .unwrap_err()
                .kind
        };
        assert_eq!(kind(abi::STATUS_ABORTED), ErrorKind::Aborted);
        assert_eq!(kind(abi::STATUS_INVALID_EXPERT), ErrorKind::InvalidArgument);
        assert_eq!(
            kind(abi::STATUS_INVALID_ARGUMENT),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            kind(abi::STATUS_INVALID_TOKEN_COUNT),
            ErrorKind::InvalidArgument
        );
        assert_eq!(kind(99), ErrorKind::Internal);
        let mismatch = DeviceStatus {
            call: word(3, 7),
            ..status(abi::STATUS_MISMATCH, 1, abi::PHASE_LL_DISPATCH, word(1, 7))
        };
        let err = mismatch.to_result().unwrap_err();
        assert_eq!(err.kind, ErrorKind::Remote);
        assert_eq!(
            err.message,
            "low-latency dispatch kernel: this rank is in ep_ll_dispatch (collective call 7 on \
             the device) but rank 1 is in ep_dispatch (collective call 7 on the device): the \
             ranks' collective calls do not match (every rank must make the same calls in the \
             same order)"
        );
    }
}
