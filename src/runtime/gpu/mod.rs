//! The GPU backend: CUDA kernels on the caller's device and stream, ranks
//! connected over NVLink.
//!
//! Work runs on the device's primary context (never created, replaced or
//! destroyed here); every call pushes it and pops it again, so the caller's
//! current context is left as it was. Kernels report failures (a timed-out
//! wait, an invalid expert id) in a status word in host-mapped memory, which
//! [`GpuMonitor`] reads from any thread.

use super::backend::{Backend, HandleState, Monitor, Stream};
use super::bootstrap::Bootstrap;
use super::config::{agree_on_config, Config};
use super::cuda::{Device, DeviceStatus, MappedHost, Module};
use super::ops::{CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp};
use crate::error::{Error, Result};
use std::os::raw::c_void;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Threads per block of the layout kernel.
const LAYOUT_THREADS: u32 = 256;

pub fn create(cfg: &Config, unique_id: &[u8; 128]) -> Result<(Box<dyn Backend>, Arc<dyn Monitor>)> {
    // Probe the driver before joining, so a machine without a GPU fails at
    // once with `CudaUnavailable`.
    let device = Device::new(cfg.device as usize)?;
    let aborted = Arc::new(AtomicBool::new(false));
    let boot = Bootstrap::connect(
        unique_id,
        cfg.rank,
        cfg.world(),
        cfg.timeout,
        aborted.clone(),
    )?;
    agree_on_config(&boot, cfg)?;
    let module = Module::load(&device)?;
    let monitor = Arc::new(GpuMonitor {
        status: MappedHost::new(&device, 1)?,
        abort_flag: MappedHost::new(&device, 1)?,
        aborted,
    });
    let backend = GpuBackend {
        cfg: *cfg,
        _boot: boot,
        module,
        monitor: monitor.clone(),
    };
    Ok((Box::new(backend), monitor))
}

/// Bytes of communication buffer one rank allocates for `cfg`.
pub fn buffer_bytes(_cfg: &Config) -> usize {
    0
}

/// The host-mapped words the kernels and any host thread share.
struct GpuMonitor {
    /// First error recorded by a kernel of this context.
    status: MappedHost<DeviceStatus>,
    /// Non-zero tells waiting kernels to give up.
    abort_flag: MappedHost<i32>,
    /// Tells host-side waits (bootstrap) to give up.
    aborted: Arc<AtomicBool>,
}

impl Monitor for GpuMonitor {
    fn async_error(&self) -> Result<()> {
        self.status.read(0).to_result()
    }

    fn abort(&self) {
        self.aborted
            .store(true, std::sync::atomic::Ordering::Release);
        self.abort_flag.write(0, 1);
        let mut status = self.status.read(0);
        if status.code == DeviceStatus::OK {
            status.code = DeviceStatus::ABORTED;
            status.rank = -1;
            self.status.write(0, status);
        }
    }
}

struct GpuBackend {
    cfg: Config,
    _boot: Bootstrap,
    module: Module,
    monitor: Arc<GpuMonitor>,
}

fn not_yet(what: &str) -> Error {
    Error::unsupported(format!(
        "{what} is not available on the GPU backend in this build"
    ))
}

impl Backend for GpuBackend {
    fn layout(&mut self, op: &LayoutOp, stream: Stream) -> Result<()> {
        let topo = self.cfg.topo;
        let kernel = self.module.function("ep_layout_kernel")?;
        let mut args = (
            op.topk_idx,
            op.num_tokens as i32,
            topo.topk as i32,
            topo.num_experts as i32,
            topo.world as i32,
            op.tokens_per_rank,
            op.tokens_per_expert,
            op.is_token_in_rank,
            self.monitor.status.device_ptr(),
        );
        let mut params: [*mut c_void; 9] = [
            &mut args.0 as *mut _ as *mut c_void,
            &mut args.1 as *mut _ as *mut c_void,
            &mut args.2 as *mut _ as *mut c_void,
            &mut args.3 as *mut _ as *mut c_void,
            &mut args.4 as *mut _ as *mut c_void,
            &mut args.5 as *mut _ as *mut c_void,
            &mut args.6 as *mut _ as *mut c_void,
            &mut args.7 as *mut _ as *mut c_void,
            &mut args.8 as *mut _ as *mut c_void,
        ];
        // SAFETY: the parameters match the kernel's signature; the caller's
        // arrays stay valid until the stream reaches the kernel (API rule).
        unsafe {
            kernel.launch(
                topo.world as u32,
                LAYOUT_THREADS,
                0,
                stream as _,
                &mut params,
            )
        }
    }

    fn new_handle_state(&mut self) -> Result<HandleState> {
        Ok(Box::new(()))
    }

    fn dispatch(
        &mut self,
        _op: &DispatchOp,
        _handle: &mut HandleState,
        _stream: Stream,
    ) -> Result<()> {
        Err(not_yet("the normal-mode dispatch"))
    }

    fn combine(&mut self, _op: &CombineOp, _handle: &HandleState, _stream: Stream) -> Result<()> {
        Err(not_yet("the normal-mode combine"))
    }

    fn ll_dispatch(&mut self, _op: &LlDispatchOp, _stream: Stream) -> Result<()> {
        Err(not_yet("the low-latency dispatch"))
    }

    fn ll_combine(&mut self, _op: &LlCombineOp, _stream: Stream) -> Result<()> {
        Err(not_yet("the low-latency combine"))
    }

    fn ll_combine_buffer(&mut self) -> Result<(*mut u8, usize)> {
        Err(not_yet("the low-latency combine buffer"))
    }
}
