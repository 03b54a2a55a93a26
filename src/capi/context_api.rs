//! Library-wide functions and the context's life cycle.

use super::entry::{deref, init_versioned, last_error_ptr, read_versioned, run, write_out};
use super::types::*;
use crate::error::{Error, Result};
use crate::reference::Dtype;
use crate::runtime::bootstrap;
use crate::runtime::config::{BackendKind, Config, ConfigRequest};
use crate::runtime::context::Context;
use crate::runtime::{gpu, host, log};
use std::ffi::c_char;
use std::mem::offset_of;

/// Writes `EP_API_VERSION` of the loaded library to `*version`. `version`
/// is required.
#[no_mangle]
pub unsafe extern "C" fn ep_get_version(version: *mut u32) -> ep_status_t {
    run("ep_get_version", || {
        write_out(version, "version", EP_API_VERSION)
    })
}

/// A static, human-readable name of a status code. Never NULL.
#[no_mangle]
pub extern "C" fn ep_get_error_string(status: ep_status_t) -> *const c_char {
    let text: &'static [u8] = match status {
        EP_SUCCESS => b"success\0",
        EP_ERR_INVALID_ARGUMENT => b"invalid argument\0",
        EP_ERR_NULL_POINTER => b"null pointer\0",
        EP_ERR_UNSUPPORTED => b"unsupported\0",
        EP_ERR_OUT_OF_MEMORY => b"out of memory\0",
        EP_ERR_CUDA_UNAVAILABLE => b"CUDA unavailable\0",
        EP_ERR_CUDA => b"CUDA error\0",
        EP_ERR_TIMEOUT => b"timeout\0",
        EP_IN_PROGRESS => b"in progress\0",
        EP_ERR_ABORTED => b"aborted\0",
        EP_ERR_INTERNAL => b"internal error\0",
        EP_ERR_SYSTEM => b"system error\0",
        EP_ERR_REMOTE => b"remote error\0",
        _ => b"unknown status code\0",
    };
    text.as_ptr() as *const c_char
}

/// The message of the last failed call on the calling thread ("" if none),
/// naming the function and the cause. Valid until the next failing call on
/// this thread; never NULL.
#[no_mangle]
pub extern "C" fn ep_get_last_error() -> *const c_char {
    last_error_ptr()
}

/// Fills `*config` with the defaults and its header. `config` is required.
#[no_mangle]
pub unsafe extern "C" fn ep_config_init(config: *mut ep_config_t) -> ep_status_t {
    run("ep_config_init", || init_versioned(config))
}

/// Makes a new unique id and starts its rendezvous service: a background
/// thread of the calling process, which must stay alive until every rank's
/// `ep_ctx_create` has returned. Call it on one rank and send the id to the
/// others. Thread-safe. An id serves one group: the service ends when the
/// group has formed, when an `ep_ctx_create` with this id fails in this
/// process (the ranks that joined are then refused with `EP_ERR_REMOTE`;
/// make a new id to try again), when a joined rank's `timeout_ms` runs out,
/// or 600 s after it started if no rank ever joins.
///
/// Pointers: `id` is required.
#[no_mangle]
pub unsafe extern "C" fn ep_get_unique_id(id: *mut ep_unique_id_t) -> ep_status_t {
    run("ep_get_unique_id", || {
        if id.is_null() {
            return Err(Error::null("id"));
        }
        let internal = bootstrap::create_unique_id()?;
        write_out(id, "id", ep_unique_id_t { internal })
    })
}

fn backend_kind(requested: i32) -> Result<BackendKind> {
    match requested {
        EP_BACKEND_GPU => Ok(BackendKind::Gpu),
        EP_BACKEND_HOST => Ok(BackendKind::Host),
        EP_BACKEND_AUTO => match std::env::var("EP_BACKEND").as_deref() {
            Err(_) | Ok("") | Ok("gpu") => Ok(BackendKind::Gpu),
            Ok("host") => Ok(BackendKind::Host),
            Ok(other) => Err(Error::invalid(format!(
                "EP_BACKEND={other}: expected `gpu` or `host`"
            ))),
        },
        other => Err(Error::invalid(format!(
            "backend = {other} is not an EP_BACKEND_* value"
        ))),
    }
}

pub(crate) fn dtype(name: &str, value: i32) -> Result<Dtype> {
    match value {
        EP_DTYPE_BF16 => Ok(Dtype::Bf16),
        EP_DTYPE_FP8_E4M3 => Ok(Dtype::Fp8E4m3),
        other => Err(Error::invalid(format!(
            "{name} = {other} is not an EP_DTYPE_* value"
        ))),
    }
}

/// Reads and validates a caller's config for one rank.
unsafe fn config_of(
    config: *const ep_config_t,
    world: i32,
    rank: i32,
    device: i32,
) -> Result<Config> {
    let c = read_versioned(config)?;
    request_of(&c, world, rank, device)
}

fn request_of(c: &ep_config_t, world: i32, rank: i32, device: i32) -> Result<Config> {
    Config::new(&ConfigRequest {
        world,
        rank,
        device,
        max_tokens_per_rank: c.max_tokens_per_rank,
        hidden: c.hidden,
        topk: c.topk,
        num_experts: c.num_experts,
        token_dtype: dtype("token_dtype", c.token_dtype)?,
        backend: backend_kind(c.backend)?,
        num_sms: c.num_sms,
        timeout_ms: c.timeout_ms,
        ll_max_tokens_per_rank: c.ll_max_tokens_per_rank,
        ranks_per_node: c.ranks_per_node,
    })
}

/// Creates the context of rank `rank` of `world_size`, on CUDA device
/// `device` (ignored by the host backend), joining the other ranks through
/// the unique id. Blocks until every rank has joined, or fails with
/// `EP_ERR_TIMEOUT` after `config->timeout_ms`. Every rank must pass the same
/// config. On the GPU backend, works on the device's primary context and
/// leaves the calling thread's current context as it was. Thread-safe for
/// distinct contexts. On failure `*ctx` is NULL, and if this process runs the
/// id's rendezvous service, it stops (see `ep_get_unique_id`).
///
/// Ranks sharing one GPU (GPU backend): ranks that are threads of one process
/// may name the same device. Each then gets `SMs / (ranks on the device)`
/// of its SMs: the low-latency kernels use one block per SM of that share,
/// the normal-mode kernels at most `num_sms` of it, so that the kernels of
/// all of them run at once and their waits for each other end. Each such
/// rank must pass its own stream to every call (the legacy default stream,
/// NULL, is refused with `EP_ERR_INVALID_ARGUMENT`: it would run their
/// kernels one after the other), and while a collective call is in flight
/// no thread of the process may wait for the whole device (allocate or free
/// device or pinned memory, destroy a context, synchronize the device, use
/// the legacy default stream, or launch a kernel for the first time, which
/// CUDA's lazy loading turns into such a wait), nor copy between the device
/// and pageable host memory on a stream with unfinished work (the copy
/// holds the driver's staging buffers while it waits; synchronize the
/// stream first or use pinned memory): such a wait also holds the other
/// threads' launches or copies, so a peer could not make its part of the call
/// before the kernels waiting for it time out. ep loads its kernels when the
/// context is created and handles need no such wait (see
/// `ep_handle_create`); make buffers and run each of your own kernels once
/// before the calls, or set `CUDA_MODULE_LOADING=EAGER`. Ranks in different
/// processes cannot share a GPU (their kernels do not run at once without
/// MPS): every rank's `ep_ctx_create` then fails with `EP_ERR_UNSUPPORTED`.
///
/// Pointers: `ctx` and `config` are required.
#[no_mangle]
pub unsafe extern "C" fn ep_ctx_create(
    ctx: *mut *mut ep_ctx_t,
    world_size: i32,
    id: ep_unique_id_t,
    rank: i32,
    device: i32,
    config: *const ep_config_t,
) -> ep_status_t {
    run("ep_ctx_create", || {
        let start = std::time::Instant::now();
        let created = deref(ctx as *const *mut ep_ctx_t, "ctx")
            .and_then(|_| read_versioned(config))
            .and_then(|requested| {
                let cfg = request_of(&requested, world_size, rank, device)?;
                log::enter(&cfg);
                log_config(&requested, &cfg);
                Context::create(cfg, &id.internal)
            });
        match created {
            Ok(inner) => {
                *ctx = Box::into_raw(Box::new(ep_ctx_t { inner }));
                log::info!(
                    "context ready in {:.1} ms",
                    start.elapsed().as_secs_f64() * 1e3
                );
                Ok(())
            }
            Err(err) => {
                // The group cannot form without this rank: stop the
                // rendezvous root if this process runs it.
                let reason = format!("rank {rank}'s ep_ctx_create failed: {}", err.message);
                bootstrap::release_unique_id(&id.internal, &reason);
                if !ctx.is_null() {
                    *ctx = std::ptr::null_mut();
                }
                Err(err)
            }
        }
    })
}

/// Creates a GPU context on the caller's NCCL communicator `comm` (borrowed:
/// ep never destroys it): the context's rank, world size and CUDA device are
/// the communicator's (`ncclCommUserRank`, `ncclCommCount`,
/// `ncclCommCuDevice`). Collective over `comm`: every rank calls it with the
/// same config. The symmetric buffers are NCCL windows (`ncclMemAlloc` +
/// `ncclCommWindowRegister`), the peers of NCCL's LSA team (the ranks
/// reached over NVLink) are reached through their LSA pointers, and a device
/// communicator carries the network leg to the other nodes. The context's
/// host-side collectives (configuration agreement, barriers) run on `comm`
/// (`ncclAllGather` on a stream of the context, with `timeout_ms`);
/// `ep_ctx_destroy` deregisters the windows, which NCCL may require of every
/// rank. `comm` must outlive the context.
///
/// NCCL is found at run time: the copy already loaded in the process
/// (`libnccl.so.2`, which must be the one that made `comm`), else
/// `EP_NCCL_LIBRARY`, else `libnccl.so.2`. Its version must be the one ep's
/// network kernels were compiled against (2.28.9): another is refused with
/// `EP_ERR_UNSUPPORTED` and a message naming both. `config->backend` must be
/// `EP_BACKEND_GPU` or `EP_BACKEND_AUTO` (which then means the GPU);
/// `ranks_per_node` 0 makes every LSA team a node. On failure `*ctx` is
/// NULL.
///
/// Pointers: `comm`, `config` and `ctx` are required.
#[no_mangle]
pub unsafe extern "C" fn ep_ctx_create_from_nccl(
    comm: *mut ncclComm,
    config: *const ep_config_t,
    ctx: *mut *mut ep_ctx_t,
) -> ep_status_t {
    run("ep_ctx_create_from_nccl", || {
        if ctx.is_null() {
            return Err(Error::null("ctx"));
        }
        *ctx = std::ptr::null_mut();
        if comm.is_null() {
            return Err(Error::null("comm"));
        }
        let c = read_versioned(config)?;
        if !matches!(c.backend, EP_BACKEND_GPU | EP_BACKEND_AUTO) {
            return Err(Error::invalid(format!(
                "backend = {}: a context on an NCCL communicator runs on the GPU backend (EP_BACKEND_GPU or EP_BACKEND_AUTO)",
                c.backend
            )));
        }
        let nccl = crate::runtime::nccl::load()?;
        let (world, rank, device) = nccl.comm_info(comm as crate::runtime::nccl::Comm)?;
        let mut cfg = request_of(&c, world as i32, rank as i32, device)?;
        cfg.backend = BackendKind::Gpu;
        log::enter(&cfg);
        let inner = Context::create_from_nccl(cfg, comm as crate::runtime::nccl::Comm)?;
        *ctx = Box::into_raw(Box::new(ep_ctx_t { inner }));
        Ok(())
    })
}

/// Frees a context and its buffers. The caller makes sure no work that uses
/// them is still running (synchronize its streams first); only the row
/// copies of a dispatch that waited for its counts, which may still run when
/// that call returns, the context waits for itself. Destroying is
/// the only way out of a context that failed for good (see
/// `ep_ctx_get_async_error`). `ctx` may be NULL (then nothing happens).
#[no_mangle]
pub unsafe extern "C" fn ep_ctx_destroy(ctx: *mut ep_ctx_t) -> ep_status_t {
    run("ep_ctx_destroy", || {
        if !ctx.is_null() {
            log::enter((*ctx).inner.config());
            drop(Box::from_raw(ctx));
            log::debug!("context destroyed");
        }
        Ok(())
    })
}

/// Makes every waiting call and in-flight kernel of this context give up:
/// they end with `EP_ERR_ABORTED`, and so does every later call. Any thread,
/// any time; the context must still be destroyed. `ctx` is required.
#[no_mangle]
pub unsafe extern "C" fn ep_ctx_abort(ctx: *mut ep_ctx_t) -> ep_status_t {
    run("ep_ctx_abort", || {
        let context = &deref(ctx, "ctx")?.inner;
        log::enter(context.config());
        log::warning!("ep_ctx_abort: the context's waits and kernels give up");
        context.abort();
        Ok(())
    })
}

/// Writes to `*status` the error that ended this context, or `EP_SUCCESS`:
/// an error raised by enqueued work, such as a device-side timeout
/// (`EP_ERR_TIMEOUT`; `ep_get_last_error` then names the rank and phase that
/// stalled), a collective of the host backend that lost or waited too long
/// for a peer, or `EP_ERR_ABORTED` after `ep_ctx_abort`. Any thread, any
/// time.
///
/// Such an error is final: the context then refuses every operation,
/// `ep_get_dispatch_layout`, `ep_handle_create` and
/// `ep_ll_get_combine_buffer` with the same status, until it is destroyed.
/// What to do: synchronize the streams the context used (on the GPU, a
/// kernel that gave up has exited), destroy the context and its handles
/// (which releases everything they held), and create new contexts on every
/// rank with a new unique id. Peers that are still in a collective call
/// with this rank end in `EP_ERR_TIMEOUT` after `timeout_ms` and must do
/// the same.
///
/// Pointers: `ctx` and `status` are required.
#[no_mangle]
pub unsafe extern "C" fn ep_ctx_get_async_error(
    ctx: *mut ep_ctx_t,
    status: *mut ep_status_t,
) -> ep_status_t {
    run("ep_ctx_get_async_error", || {
        let context = &deref(ctx, "ctx")?.inner;
        log::enter(context.config());
        let result = context.async_error();
        let code = run("ep_ctx_get_async_error", || result);
        write_out(status, "status", code)
    })
}

/// Writes this context's rank, world size, local expert count and backend
/// (`EP_BACKEND_GPU` or `EP_BACKEND_HOST`).
///
/// Pointers: `ctx` is required. `rank`, `world_size`, `num_local_experts`,
/// `backend`: may be NULL (then not written).
#[no_mangle]
pub unsafe extern "C" fn ep_ctx_get_info(
    ctx: *const ep_ctx_t,
    rank: *mut i32,
    world_size: *mut i32,
    num_local_experts: *mut i32,
    backend: *mut i32,
) -> ep_status_t {
    run("ep_ctx_get_info", || {
        let cfg = deref(ctx, "ctx")?.inner.config();
        let backend_code = match cfg.backend {
            BackendKind::Gpu => EP_BACKEND_GPU,
            BackendKind::Host => EP_BACKEND_HOST,
        };
        let outputs = [
            (rank, cfg.rank as i32),
            (world_size, cfg.world() as i32),
            (num_local_experts, cfg.local_experts() as i32),
            (backend, backend_code),
        ];
        for (ptr, value) in outputs {
            if !ptr.is_null() {
                *ptr = value;
            }
        }
        Ok(())
    })
}

/// Writes this context's node shape: ranks per node (as configured, or as
/// the hosts decided when the config said 0) and the number of nodes. More
/// than one node means the hierarchical modes run.
///
/// Pointers: `ctx` is required; `ranks_per_node` and `num_nodes` may be NULL
/// (then that value is not written).
#[no_mangle]
pub unsafe extern "C" fn ep_ctx_get_node_info(
    ctx: *const ep_ctx_t,
    ranks_per_node: *mut i32,
    num_nodes: *mut i32,
) -> ep_status_t {
    run("ep_ctx_get_node_info", || {
        let nodes = deref(ctx, "ctx")?.inner.config().nodes();
        if !ranks_per_node.is_null() {
            *ranks_per_node = nodes.ranks_per_node as i32;
        }
        if !num_nodes.is_null() {
            *num_nodes = nodes.nodes() as i32;
        }
        Ok(())
    })
}

/// Bytes of communication buffer one rank allocates for `config` with
/// `world_size` ranks, on the backend the config selects.
///
/// Pointers: `config` and `bytes` are required.
#[no_mangle]
pub unsafe extern "C" fn ep_get_buffer_size_hint(
    config: *const ep_config_t,
    world_size: i32,
    bytes: *mut usize,
) -> ep_status_t {
    run("ep_get_buffer_size_hint", || {
        let cfg = config_of(config, world_size, 0, 0)?;
        let size = match cfg.backend {
            BackendKind::Host => host::buffer_bytes(&cfg),
            BackendKind::Gpu => gpu::buffer_bytes(&cfg),
        };
        write_out(bytes, "bytes", size)
    })
}

/// The INFO lines of a new context's configuration: the library's version,
/// the backend and why, and every field with where its value came from
/// (set by the caller, the default, or the default because the caller's
/// struct is from an older release and lacks the field).
fn log_config(requested: &ep_config_t, cfg: &Config) {
    if !log::enabled(log::Level::Info) {
        return;
    }
    let backend_source = match (requested.backend, std::env::var("EP_BACKEND")) {
        (EP_BACKEND_AUTO, Ok(v)) if !v.is_empty() => format!("EP_BACKEND={v}"),
        (EP_BACKEND_AUTO, _) => "default".to_string(),
        _ => "config".to_string(),
    };
    let (backend, device) = match cfg.backend {
        BackendKind::Gpu => ("gpu", format!(", device {}", cfg.device)),
        BackendKind::Host => ("host", String::new()),
    };
    log::info!(
        "ep {} (API {EP_API_VERSION}), backend {backend} ({backend_source}), rank {} of {}{device}",
        env!("CARGO_PKG_VERSION"),
        cfg.rank,
        cfg.world(),
    );
    let (c, d) = (
        requested,
        <ep_config_t as super::entry::Versioned>::defaults(),
    );
    let dtype_name = |v: i32| match v {
        EP_DTYPE_FP8_E4M3 => "FP8".to_string(),
        EP_DTYPE_BF16 => "BF16".to_string(),
        other => other.to_string(),
    };
    // (name, offset, value, default) of each field.
    macro_rules! field {
        ($name:ident, $show:expr) => {
            (
                stringify!($name),
                offset_of!(ep_config_t, $name),
                $show(c.$name),
                $show(d.$name),
            )
        };
        ($name:ident) => {
            field!($name, |v: _| format!("{v}"))
        };
    }
    let fields = [
        field!(max_tokens_per_rank),
        field!(hidden),
        field!(topk),
        field!(num_experts),
        field!(token_dtype, dtype_name),
        field!(num_sms),
        field!(timeout_ms),
        field!(ll_max_tokens_per_rank),
    ];
    let described: Vec<String> = fields
        .iter()
        .map(|(name, offset, value, default)| {
            let source = if *offset >= c.struct_size as usize {
                "default: older struct"
            } else if value == default {
                "default"
            } else {
                "set"
            };
            format!("{name} {value} ({source})")
        })
        .collect();
    log::info!("config: {}", described.join(", "));
}
