//! The context behind `ep_ctx_t`: one rank's configuration, its backend, and
//! the state that any thread may query.

use super::backend::{Backend, Monitor, Stream};
use super::config::{BackendKind, Config};
use super::handle::Handle;
use super::ops::{CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp};
use super::{gpu, host};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

static NEXT_CONTEXT_ID: AtomicU64 = AtomicU64::new(1);

pub struct Context {
    id: u64,
    cfg: Config,
    /// Operations hold this lock, so one thread at a time runs them (the
    /// header's rule); a second thread waits rather than racing.
    backend: Mutex<Box<dyn Backend>>,
    monitor: Arc<dyn Monitor>,
}

impl Context {
    /// Joins the group described by `unique_id` and sets up the backend.
    /// The backend fixes what the configuration left to the hosts
    /// (`ranks_per_node`).
    pub fn create(mut cfg: Config, unique_id: &[u8; 128]) -> Result<Context> {
        let (backend, monitor) = match cfg.backend {
            BackendKind::Host => host::create(&mut cfg, unique_id)?,
            BackendKind::Gpu => gpu::create(&mut cfg, unique_id)?,
        };
        Ok(Context {
            id: NEXT_CONTEXT_ID.fetch_add(1, Ordering::Relaxed),
            cfg,
            backend: Mutex::new(backend),
            monitor,
        })
    }

    /// A GPU context on the caller's NCCL communicator.
    ///
    /// # Safety
    /// `comm` is a live communicator of the loaded NCCL that outlives the
    /// context.
    pub unsafe fn create_from_nccl(mut cfg: Config, comm: super::nccl::Comm) -> Result<Context> {
        let (backend, monitor) = gpu::create_from_nccl(&mut cfg, comm)?;
        Ok(Context {
            id: NEXT_CONTEXT_ID.fetch_add(1, Ordering::Relaxed),
            cfg,
            backend: Mutex::new(backend),
            monitor,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn abort(&self) {
        self.monitor.abort();
    }

    pub fn async_error(&self) -> Result<()> {
        self.monitor.async_error()
    }

    /// Locks the backend for one operation, refusing when enqueued work has
    /// already failed (the context must then be destroyed).
    fn backend(&self) -> Result<MutexGuard<'_, Box<dyn Backend>>> {
        self.monitor.async_error()?;
        self.backend
            .lock()
            .map_err(|_| Error::internal("an earlier call panicked inside this context"))
    }

    pub fn layout(&self, op: &LayoutOp, stream: Stream) -> Result<()> {
        op.validate_outputs()?;
        self.backend()?.layout(op, stream)
    }

    pub fn new_handle(&self) -> Result<Handle> {
        Ok(Handle {
            ctx_id: self.id,
            has_layout: false,
            state: self.backend()?.new_handle_state()?,
        })
    }

    fn check_handle(&self, handle: &Handle) -> Result<()> {
        if handle.ctx_id != self.id {
            return Err(Error::invalid("the handle belongs to another context"));
        }
        Ok(())
    }

    pub fn dispatch(&self, op: &DispatchOp, handle: &mut Handle, stream: Stream) -> Result<()> {
        op.validate(&self.cfg)?;
        self.check_handle(handle)?;
        if op.reuse_layout && !handle.has_layout {
            return Err(Error::invalid(
                "EP_DISPATCH_REUSE_LAYOUT with a handle that holds no layout yet",
            ));
        }
        handle.has_layout = false;
        self.backend()?.dispatch(op, &mut handle.state, stream)?;
        handle.has_layout = true;
        Ok(())
    }

    pub fn combine(&self, op: &CombineOp, handle: &Handle, stream: Stream) -> Result<()> {
        self.check_handle(handle)?;
        if !handle.has_layout {
            return Err(Error::invalid(
                "the handle holds no layout: pass the handle of a successful ep_dispatch",
            ));
        }
        self.backend()?.combine(op, &handle.state, stream)
    }

    pub fn ll_dispatch(&self, op: &LlDispatchOp, stream: Stream) -> Result<()> {
        op.validate(&self.cfg)?;
        self.backend()?.ll_dispatch(op, stream)
    }

    pub fn ll_combine(&self, op: &LlCombineOp, stream: Stream) -> Result<()> {
        op.validate(&self.cfg)?;
        self.backend()?.ll_combine(op, stream)
    }

    pub fn ll_combine_buffer(&self) -> Result<(*mut u8, usize)> {
        if self.cfg.ll_max_tokens == 0 {
            return Err(Error::invalid(
                "the low-latency mode is disabled (config ll_max_tokens_per_rank = 0)",
            ));
        }
        self.backend()?.ll_combine_buffer()
    }
}
