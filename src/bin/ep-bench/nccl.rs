//! NCCL all-to-all baseline, loaded at run time with dlopen so that the
//! benchmark runs (and says "NCCL: not available") where NCCL is missing.

use std::ffi::{c_char, c_int, c_void, CStr};

use crate::device::{fail, Buf, Dev};

type NcclComm = *mut c_void;
type NcclResult = c_int;

/// `ncclDataType_t` value of `ncclUint8` (nccl.h: ncclInt8 = 0, ncclUint8 = 1).
const NCCL_UINT8: c_int = 1;
const NCCL_SUCCESS: NcclResult = 0;

type FnInitAll = unsafe extern "C" fn(*mut NcclComm, c_int, *const c_int) -> NcclResult;
type FnGroup = unsafe extern "C" fn() -> NcclResult;
type FnSendRecv =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult;
type FnDestroy = unsafe extern "C" fn(NcclComm) -> NcclResult;
type FnErr = unsafe extern "C" fn(NcclResult) -> *const c_char;
type FnVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;

#[derive(Clone, Copy)]
pub struct Nccl {
    init_all: FnInitAll,
    group_start: FnGroup,
    group_end: FnGroup,
    send: FnSendRecv,
    recv: FnSendRecv,
    destroy: FnDestroy,
    err: Option<FnErr>,
    pub version: i32,
}

/// One communicator of one rank (sent to that rank's thread).
#[derive(Clone, Copy)]
pub struct Comm(pub NcclComm);
// SAFETY: a communicator is used by one thread at a time: its rank's.
unsafe impl Send for Comm {}

unsafe fn sym<T: Copy>(lib: *mut c_void, name: &str) -> Result<T, String> {
    let c = std::ffi::CString::new(name).unwrap();
    let p = libc::dlsym(lib, c.as_ptr());
    if p.is_null() {
        return Err(format!("symbol {name} missing"));
    }
    Ok(std::mem::transmute_copy::<*mut c_void, T>(&p))
}

impl Nccl {
    /// Loads libnccl.so.2 (NCCL_NVLS_ENABLE must already be set).
    pub fn load() -> Result<Nccl, String> {
        let names = [
            "libnccl.so.2",
            "/usr/lib/x86_64-linux-gnu/libnccl.so.2",
            "libnccl.so",
        ];
        // SAFETY: dlopen/dlsym with NUL-terminated names; the library stays loaded.
        unsafe {
            let mut lib = std::ptr::null_mut();
            for n in names {
                let c = std::ffi::CString::new(n).unwrap();
                lib = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
                if !lib.is_null() {
                    break;
                }
            }
            if lib.is_null() {
                return Err("libnccl.so.2 not found".into());
            }
            let get_version: FnVersion = sym(lib, "ncclGetVersion")?;
            let mut version = 0;
            get_version(&mut version);
            Ok(Nccl {
                init_all: sym(lib, "ncclCommInitAll")?,
                group_start: sym(lib, "ncclGroupStart")?,
                group_end: sym(lib, "ncclGroupEnd")?,
                send: sym(lib, "ncclSend")?,
                recv: sym(lib, "ncclRecv")?,
                destroy: sym(lib, "ncclCommDestroy")?,
                err: sym(lib, "ncclGetErrorString").ok(),
                version,
            })
        }
    }

    fn check(&self, r: NcclResult, what: &str) -> Result<(), String> {
        if r == NCCL_SUCCESS {
            return Ok(());
        }
        let msg = match self.err {
            // SAFETY: returns a static string.
            Some(f) => unsafe { CStr::from_ptr(f(r)).to_string_lossy().into_owned() },
            None => String::new(),
        };
        Err(format!("{what}: NCCL error {r} {msg}"))
    }

    /// One communicator per device 0..n, created from this thread.
    pub fn init_all(&self, n: i32) -> Result<Vec<Comm>, String> {
        let mut comms = vec![std::ptr::null_mut(); n as usize];
        let devs: Vec<c_int> = (0..n).collect();
        // SAFETY: arrays of n entries.
        let r = unsafe { (self.init_all)(comms.as_mut_ptr(), n, devs.as_ptr()) };
        self.check(r, "ncclCommInitAll")?;
        Ok(comms.into_iter().map(Comm).collect())
    }

    pub fn destroy(&self, c: Comm) {
        // SAFETY: a communicator from init_all, used no more.
        unsafe { (self.destroy)(c.0) };
    }

    /// Enqueues one all-to-all on the rank's stream: `send_bytes[p]` bytes to
    /// peer `p` (itself included) and `recv_bytes[p]` from it, packed in peer order.
    pub fn all_to_all(
        &self,
        comm: Comm,
        dev: &Dev,
        send: &Buf,
        send_bytes: &[usize],
        recv: &Buf,
        recv_bytes: &[usize],
    ) {
        let stream = dev.stream.cast::<c_void>();
        let (mut so, mut ro) = (0usize, 0usize);
        let mut run = || -> Result<(), String> {
            // SAFETY: offsets stay inside the buffers (sized from the same counts).
            unsafe {
                self.check((self.group_start)(), "ncclGroupStart")?;
                for p in 0..send_bytes.len() {
                    let sp = send.ptr.cast::<u8>().add(so).cast();
                    let rp = recv.ptr.cast::<u8>().add(ro).cast();
                    self.check(
                        (self.send)(sp, send_bytes[p], NCCL_UINT8, p as c_int, comm.0, stream),
                        "ncclSend",
                    )?;
                    self.check(
                        (self.recv)(rp, recv_bytes[p], NCCL_UINT8, p as c_int, comm.0, stream),
                        "ncclRecv",
                    )?;
                    so += send_bytes[p];
                    ro += recv_bytes[p];
                }
                self.check((self.group_end)(), "ncclGroupEnd")
            }
        };
        assert!(
            send_bytes.iter().sum::<usize>() <= send.bytes
                && recv_bytes.iter().sum::<usize>() <= recv.bytes
        );
        if let Err(e) = run() {
            fail(&e);
        }
    }
}
