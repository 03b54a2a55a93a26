//! Device access for the benchmark: checked CUDA driver calls, buffers that
//! live in GPU memory (GPU backend) or host memory (host backend), timers,
//! the start gate of timed sections, and the checked `ep` call wrapper.

use std::cell::Cell;
use std::ffi::{c_void, CStr};
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use cudarc::driver::sys;
use ep::capi::*;

/// Prints the message and ends the whole process with status 1. Ranks are
/// threads waiting on each other, so one failing rank must not leave the
/// others blocked at a barrier or inside a kernel.
pub fn fail(msg: &str) -> ! {
    eprintln!("ep-bench: error: {msg}");
    std::process::exit(1);
}

/// Checks a CUDA driver result.
pub fn cu(res: sys::CUresult, what: &str) {
    if res != sys::CUresult::CUDA_SUCCESS {
        let mut s: *const std::ffi::c_char = ptr::null();
        // SAFETY: cuGetErrorString writes a static string pointer or leaves it NULL.
        let name = unsafe {
            if sys::cuGetErrorString(res, &mut s) == sys::CUresult::CUDA_SUCCESS && !s.is_null() {
                CStr::from_ptr(s).to_string_lossy().into_owned()
            } else {
                format!("{res:?}")
            }
        };
        fail(&format!("{what}: {name} ({res:?})"));
    }
}

/// Checks an `ep` status; on failure prints `ep_get_last_error`.
pub fn epc(status: ep_status_t, what: &str) {
    if status != EP_SUCCESS {
        // SAFETY: both return static or thread-local NUL-terminated strings.
        let (name, last) = unsafe {
            (
                CStr::from_ptr(ep_get_error_string(status))
                    .to_string_lossy()
                    .into_owned(),
                CStr::from_ptr(ep_get_last_error())
                    .to_string_lossy()
                    .into_owned(),
            )
        };
        fail(&format!("{what} failed: {name} ({status}): {last}"));
    }
}

/// Whether libcuda can be loaded (cudarc panics when it cannot).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// Number of CUDA devices (cuInit first).
pub fn init_driver() -> i32 {
    let mut n = 0;
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        cu(sys::cuInit(0), "cuInit");
        cu(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount");
    }
    n
}

pub fn device_name(ordinal: i32) -> String {
    let mut name = [0 as std::ffi::c_char; 256];
    let mut dev: sys::CUdevice = 0;
    // SAFETY: the buffer is 256 bytes long.
    unsafe {
        cu(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet");
        cu(
            sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev),
            "cuDeviceGetName",
        );
        CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned()
    }
}

/// Per-rank device state: the GPU's primary context made current on the
/// calling thread, one stream and a pool of timing events. `gpu == false`
/// is the host backend: no CUDA at all, host memory, wall-clock timing.
pub struct Dev {
    pub gpu: bool,
    pub stream: sys::CUstream,
    events: Vec<sys::CUevent>,
}

impl Dev {
    pub fn new(gpu: bool, ordinal: i32) -> Dev {
        if !gpu {
            return Dev {
                gpu,
                stream: ptr::null_mut(),
                events: Vec::new(),
            };
        }
        let mut dev: sys::CUdevice = 0;
        let mut ctx: sys::CUcontext = ptr::null_mut();
        let mut stream: sys::CUstream = ptr::null_mut();
        let mut events = Vec::new();
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            cu(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet");
            cu(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            );
            cu(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
            cu(
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32,
                ),
                "cuStreamCreate",
            );
            for _ in 0..8 {
                let mut e: sys::CUevent = ptr::null_mut();
                cu(
                    sys::cuEventCreate(&mut e, sys::CUevent_flags_enum::CU_EVENT_DEFAULT as u32),
                    "cuEventCreate",
                );
                events.push(e);
            }
        }
        Dev {
            gpu,
            stream,
            events,
        }
    }

    pub fn ep_stream(&self) -> ep_stream_t {
        self.stream.cast()
    }

    pub fn sync(&self) {
        if self.gpu {
            // SAFETY: our stream.
            cu(
                unsafe { sys::cuStreamSynchronize(self.stream) },
                "cuStreamSynchronize",
            );
        }
    }

    /// Starts a timed section: returns a mark (event slot or host instant).
    pub fn mark(&self, slot: usize) -> Mark {
        if self.gpu {
            // SAFETY: our event and stream.
            cu(
                unsafe { sys::cuEventRecord(self.events[slot], self.stream) },
                "cuEventRecord",
            );
            Mark { slot, at: None }
        } else {
            Mark {
                slot,
                at: Some(Instant::now()),
            }
        }
    }

    /// Microseconds between two marks; waits for the later one.
    pub fn elapsed_us(&self, a: &Mark, b: &Mark) -> f64 {
        match (a.at, b.at) {
            (Some(x), Some(y)) => (y - x).as_secs_f64() * 1e6,
            _ => {
                let mut ms = 0f32;
                // SAFETY: both events were recorded on our stream.
                unsafe {
                    cu(
                        sys::cuEventSynchronize(self.events[b.slot]),
                        "cuEventSynchronize",
                    );
                    cu(
                        sys::cuEventElapsedTime_v2(
                            &mut ms,
                            self.events[a.slot],
                            self.events[b.slot],
                        ),
                        "cuEventElapsedTime",
                    );
                }
                ms as f64 * 1e3
            }
        }
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        if self.gpu {
            // SAFETY: ours; errors at teardown are ignored.
            unsafe {
                sys::cuStreamSynchronize(self.stream);
                for &e in &self.events {
                    sys::cuEventDestroy_v2(e);
                }
                sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}

pub struct Mark {
    slot: usize,
    at: Option<Instant>,
}

/// A word of pinned host memory mapped into every context (portable), for
/// the [`Gate`]: rank 0 allocates it and owns it, the other ranks map it.
pub struct HostWord(*mut u32);

impl HostWord {
    /// `None` when the driver refuses (the gate is then not used).
    pub fn alloc() -> Option<HostWord> {
        let mut p: *mut c_void = ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: valid out-pointer; the word is zeroed before anyone maps it.
        unsafe {
            if sys::cuMemHostAlloc(&mut p, 4, flags) != sys::CUresult::CUDA_SUCCESS {
                return None;
            }
            p.cast::<u32>().write(0);
        }
        Some(HostWord(p.cast()))
    }

    pub fn addr(&self) -> usize {
        self.0 as usize
    }
}

impl Drop for HostWord {
    fn drop(&mut self) {
        // SAFETY: ours; every rank's stream has passed its last wait on it
        // (the owner drops it after the ranks' final barrier).
        unsafe { sys::cuMemFreeHost(self.0.cast()) };
    }
}

/// Holds a rank's stream at the start of a timed section until every rank
/// has enqueued the section: the stream waits (`cuStreamWaitValue32`) for
/// the shared host word to reach the section's number, which rank 0 stores
/// after a barrier of all ranks. The events of the section then time the
/// GPU's work only, not the host's launch latency, and all GPUs start
/// together.
pub struct Gate {
    device_word: sys::CUdeviceptr,
    /// Rank 0's: the word it stores to; `None` on the other ranks.
    owner: Option<HostWord>,
    /// Sections held so far: the number the next section waits for.
    held: Cell<u32>,
}

impl Gate {
    /// Maps the word at `addr` into this rank's context and checks that
    /// its stream can wait on it; `None` when the driver cannot.
    pub fn new(dev: &Dev, addr: usize, owner: Option<HostWord>) -> Option<Gate> {
        let mut device_word: sys::CUdeviceptr = 0;
        // SAFETY: `addr` is a live portable, device-mapped allocation; the
        // probe waits for 0, which the word already holds. An old driver
        // lacks the symbol and cudarc panics, hence catch_unwind.
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device_word, addr as *mut c_void, 0)
                == sys::CUresult::CUDA_SUCCESS
                && sys::cuStreamWaitValue32_v2(
                    dev.stream,
                    device_word,
                    0,
                    sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32,
                ) == sys::CUresult::CUDA_SUCCESS
        }))
        .unwrap_or(false);
        dev.sync();
        ok.then(|| Gate {
            device_word,
            owner,
            held: Cell::new(0),
        })
    }

    /// Enqueues the wait of the next section on the rank's stream. Nothing
    /// that waits for this stream may run on the host until [`Gate::open`].
    pub fn hold(&self, dev: &Dev) {
        self.held.set(self.held.get() + 1);
        // SAFETY: the word stays mapped while the gate lives.
        cu(
            unsafe {
                sys::cuStreamWaitValue32_v2(
                    dev.stream,
                    self.device_word,
                    self.held.get(),
                    sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32,
                )
            },
            "cuStreamWaitValue32",
        );
    }

    /// Releases the section every rank holds (stores on rank 0 only; call
    /// after all ranks have enqueued it).
    pub fn open(&self) {
        if let Some(word) = &self.owner {
            // SAFETY: a live, 4-byte aligned word that only this thread
            // writes; the GPUs read it over the bus.
            unsafe { AtomicU32::from_ptr(word.0) }.store(self.held.get(), Ordering::Release);
        }
    }
}

/// A buffer in the memory the backend works on.
pub struct Buf {
    pub ptr: *mut c_void,
    pub bytes: usize,
    gpu: bool,
    _host: Vec<u64>,
}

impl Buf {
    /// Zero-filled buffer of `bytes` (at least 8, so that the pointer is never NULL).
    pub fn new(dev: &Dev, bytes: usize) -> Buf {
        let alloc = bytes.max(8).div_ceil(256) * 256;
        if dev.gpu {
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: plain allocation, then zeroing on our stream.
            unsafe {
                cu(
                    sys::cuMemAlloc_v2(&mut p, alloc),
                    &format!("cuMemAlloc of {alloc} bytes"),
                );
                cu(
                    sys::cuMemsetD8Async(p, 0, alloc, dev.stream),
                    "cuMemsetD8Async",
                );
            }
            Buf {
                ptr: p as *mut c_void,
                bytes,
                gpu: true,
                _host: Vec::new(),
            }
        } else {
            let mut host = vec![0u64; alloc / 8];
            Buf {
                ptr: host.as_mut_ptr().cast(),
                bytes,
                gpu: false,
                _host: host,
            }
        }
    }

    pub fn from_slice<T: Copy>(dev: &Dev, data: &[T]) -> Buf {
        let b = Buf::new(dev, std::mem::size_of_val(data));
        b.upload(dev, data, 0);
        b
    }

    pub fn i32p(&self) -> *mut i32 {
        self.ptr.cast()
    }

    pub fn f32p(&self) -> *mut f32 {
        self.ptr.cast()
    }

    /// Copies `data` to byte offset `offset`, ordered after all earlier work.
    pub fn upload<T: Copy>(&self, dev: &Dev, data: &[T], offset: usize) {
        let n = std::mem::size_of_val(data);
        assert!(offset + n <= self.bytes.max(8));
        if self.gpu {
            // The stream is idle before the copy: a copy from pageable memory
            // may hold the driver's staging buffers while it waits for its
            // stream, and ranks sharing the GPU copy through them too. The
            // whole device is never waited for (a peer's kernel may be
            // waiting for this rank).
            dev.sync();
            // SAFETY: in bounds; `data` outlives the sync after the copy.
            unsafe {
                cu(
                    sys::cuMemcpyHtoDAsync_v2(
                        self.ptr as sys::CUdeviceptr + offset as u64,
                        data.as_ptr().cast(),
                        n,
                        dev.stream,
                    ),
                    "cuMemcpyHtoDAsync",
                );
            }
            dev.sync();
        } else {
            // SAFETY: in bounds, distinct allocations.
            unsafe {
                ptr::copy_nonoverlapping(
                    data.as_ptr().cast::<u8>(),
                    self.ptr.cast::<u8>().add(offset),
                    n,
                )
            }
        }
    }

    /// Reads the first `n` elements after all work on the stream.
    pub fn download<T: Copy + Default>(&self, dev: &Dev, n: usize) -> Vec<T> {
        let mut out = vec![T::default(); n];
        let bytes = std::mem::size_of_val(out.as_slice());
        assert!(bytes <= self.bytes.max(8));
        if self.gpu {
            // Idle stream first, as in `upload`.
            dev.sync();
            // SAFETY: in bounds; `out` outlives the sync after the copy.
            unsafe {
                cu(
                    sys::cuMemcpyDtoHAsync_v2(
                        out.as_mut_ptr().cast(),
                        self.ptr as sys::CUdeviceptr,
                        bytes,
                        dev.stream,
                    ),
                    "cuMemcpyDtoHAsync",
                );
            }
            dev.sync();
        } else {
            // SAFETY: in bounds.
            unsafe {
                ptr::copy_nonoverlapping(
                    self.ptr.cast::<u8>(),
                    out.as_mut_ptr().cast::<u8>(),
                    bytes,
                )
            }
        }
        out
    }

    /// Copies all of `src` (no larger than this buffer) into this buffer,
    /// in stream order.
    pub fn copy_from(&self, dev: &Dev, src: &Buf) {
        assert!(
            src.bytes <= self.bytes,
            "copy of {} bytes into {}",
            src.bytes,
            self.bytes
        );
        if self.gpu {
            // SAFETY: both our allocations, `src.bytes` fit in each; our stream.
            cu(
                unsafe {
                    sys::cuMemcpyDtoDAsync_v2(
                        self.ptr as sys::CUdeviceptr,
                        src.ptr as sys::CUdeviceptr,
                        src.bytes,
                        dev.stream,
                    )
                },
                "cuMemcpyDtoDAsync",
            );
        } else {
            // SAFETY: two distinct allocations, in bounds.
            unsafe {
                ptr::copy_nonoverlapping(src.ptr.cast::<u8>(), self.ptr.cast::<u8>(), src.bytes)
            }
        }
    }

    /// Sets every byte to `byte`, in stream order (poisoning outputs).
    pub fn fill(&self, dev: &Dev, byte: u8) {
        if self.gpu {
            // SAFETY: our allocation and stream.
            cu(
                unsafe {
                    sys::cuMemsetD8Async(self.ptr as sys::CUdeviceptr, byte, self.bytes, dev.stream)
                },
                "cuMemsetD8Async",
            );
        } else {
            // SAFETY: in bounds.
            unsafe { ptr::write_bytes(self.ptr.cast::<u8>(), byte, self.bytes) }
        }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if self.gpu {
            // SAFETY: ours; a failure at teardown is ignored.
            unsafe {
                sys::cuCtxSynchronize();
                sys::cuMemFree_v2(self.ptr as sys::CUdeviceptr);
            }
        }
    }
}

/// Graph capture of a closure on the rank's stream; returns the executable graph.
pub fn capture_graph(dev: &Dev, mut body: impl FnMut()) -> sys::CUgraphExec {
    let mut graph: sys::CUgraph = ptr::null_mut();
    let mut exec: sys::CUgraphExec = ptr::null_mut();
    // SAFETY: capture on our own stream, thread-local mode so other ranks'
    // threads are not affected.
    unsafe {
        cu(
            sys::cuStreamBeginCapture_v2(
                dev.stream,
                sys::CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            ),
            "cuStreamBeginCapture",
        );
        body();
        cu(
            sys::cuStreamEndCapture(dev.stream, &mut graph),
            "cuStreamEndCapture",
        );
        cu(
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
            "cuGraphInstantiate",
        );
        cu(sys::cuGraphDestroy(graph), "cuGraphDestroy");
    }
    exec
}

pub fn launch_graph(dev: &Dev, exec: sys::CUgraphExec) {
    // SAFETY: an instantiated graph of this context.
    cu(
        unsafe { sys::cuGraphLaunch(exec, dev.stream) },
        "cuGraphLaunch",
    );
}

pub fn destroy_graph(exec: sys::CUgraphExec) {
    // SAFETY: ours, no longer running (the caller synchronized).
    cu(
        unsafe { sys::cuGraphExecDestroy(exec) },
        "cuGraphExecDestroy",
    );
}
