//! Safe owners of the verbs objects one executor uses, each released by `Drop`: [`Context`]
//! (`ibv_open_device` / `ibv_close_device`), [`ProtectionDomain`], [`MemoryRegion`],
//! [`CompletionQueue`] and [`QueuePair`]. Each holds an `Arc` of what it was created from, so
//! the release order (queue pairs, then completion queues and regions, then the protection
//! domain, then the context, then the library) follows from ownership.
//!
//! Thread safety: libibverbs' calls are thread safe (rdma-core documents every verb as safe to
//! call concurrently; providers lock their queues), so the shared wrappers are `Send + Sync`;
//! [`QueuePair`] posts through `&mut self` with its own scratch buffers and is `Send` only.

use std::io;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;

use super::flow::{INLINE_MAX, Payload, PostSink, WorkRequest};
use super::qp_state::Transition;
use super::sys::{self, IbvContext, IbvCq, IbvGid, IbvMr, IbvPd, IbvPortAttr, IbvQp, IbvWc};
use super::{DeviceInfo, Verbs, VerbsError};

/// An open RDMA device.
pub struct Context {
    verbs: Arc<Verbs>,
    ptr: NonNull<IbvContext>,
    name: String,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

// SAFETY: an `ibv_context` may be used from any thread (libibverbs' verbs are thread safe);
// the wrapper holds no thread-bound state.
unsafe impl Send for Context {}
// SAFETY: as above: every method calls a thread-safe verb.
unsafe impl Sync for Context {}

impl Context {
    /// Opens the device named `name`.
    ///
    /// # Errors
    /// [`VerbsError::NoDevice`], [`VerbsError::DeviceNotFound`] (listing the devices),
    /// [`VerbsError::Call`] for `ibv_open_device`.
    pub fn open(verbs: &Arc<Verbs>, name: &str) -> Result<Context, VerbsError> {
        let opened =
            verbs.with_device_list(|devices: &[(DeviceInfo, *mut sys::IbvDevice)]| {
                let Some((_, device)) = devices.iter().find(|(d, _)| d.name == name) else {
                    return Err(VerbsError::DeviceNotFound {
                        name: name.to_string(),
                        available: devices.iter().map(|(d, _)| d.name.clone()).collect(),
                    });
                };
                // SAFETY: `device` is an entry of the live device list (`with_device_list`); an
                // opened context stays valid after the list is freed.
                let ptr = unsafe { (verbs.qp.open_device)(*device) };
                NonNull::new(ptr).ok_or_else(|| VerbsError::Call {
                    call: "ibv_open_device",
                    device: name.to_string(),
                    source: io::Error::last_os_error(),
                })
            })??;
        Ok(Context {
            verbs: Arc::clone(verbs),
            ptr: opened,
            name: name.to_string(),
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The library.
    pub fn verbs(&self) -> &Arc<Verbs> {
        &self.verbs
    }

    fn call_error(&self, call: &'static str, source: io::Error) -> VerbsError {
        VerbsError::Call {
            call,
            device: self.name.clone(),
            source,
        }
    }

    /// `ibv_query_port` (the compatible symbol; `port_cap_flags2` stays 0, see [`sys`]).
    ///
    /// # Errors
    /// [`VerbsError::Call`] (a port that does not exist is `EINVAL`).
    pub fn query_port(&self, port: u8) -> Result<IbvPortAttr, VerbsError> {
        let mut attr = IbvPortAttr::default();
        // SAFETY: the context is open; `attr` is a zeroed full `ibv_port_attr`, larger than
        // the compatible prefix the exported symbol writes.
        let rc = unsafe { (self.verbs.qp.query_port)(self.ptr.as_ptr(), port, &mut attr) };
        if rc != 0 {
            return Err(self.call_error("ibv_query_port", errno_of(rc)));
        }
        Ok(attr)
    }

    /// `ibv_query_gid`: the GID at `index` of `port`, in network order.
    ///
    /// # Errors
    /// [`VerbsError::Call`].
    pub fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16], VerbsError> {
        let mut gid = IbvGid::default();
        // SAFETY: the context is open; `gid` is a live `union ibv_gid`.
        let rc = unsafe {
            (self.verbs.qp.query_gid)(self.ptr.as_ptr(), port, c_int::from(index), &mut gid)
        };
        if rc != 0 {
            return Err(self.call_error("ibv_query_gid", errno_of(rc)));
        }
        Ok(gid.raw)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by `ibv_open_device`, closed once; every object created from it holds
        // an `Arc` of this context and was released before.
        let _ = unsafe { (self.verbs.qp.close_device)(self.ptr.as_ptr()) };
    }
}

/// `errno` for a verb that returns -1 and sets `errno`, or returns the error number itself.
fn errno_of(rc: c_int) -> io::Error {
    if rc > 0 {
        io::Error::from_raw_os_error(rc)
    } else {
        io::Error::last_os_error()
    }
}

/// A protection domain.
pub struct ProtectionDomain {
    context: Arc<Context>,
    ptr: NonNull<IbvPd>,
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.context.name)
            .finish_non_exhaustive()
    }
}

// SAFETY: see `Context`.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see `Context`.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// `ibv_alloc_pd`.
    ///
    /// # Errors
    /// [`VerbsError::Call`].
    pub fn new(context: &Arc<Context>) -> Result<ProtectionDomain, VerbsError> {
        // SAFETY: the context is open (held by the `Arc`).
        let ptr = unsafe { (context.verbs.qp.alloc_pd)(context.ptr.as_ptr()) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| context.call_error("ibv_alloc_pd", io::Error::last_os_error()))?;
        Ok(ProtectionDomain {
            context: Arc::clone(context),
            ptr,
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: allocated by `ibv_alloc_pd`, freed once; its regions and queue pairs hold an
        // `Arc` of it and were released before.
        let _ = unsafe { (self.context.verbs.qp.dealloc_pd)(self.ptr.as_ptr()) };
    }
}

/// A registered memory region.
pub struct MemoryRegion {
    pd: Arc<ProtectionDomain>,
    ptr: NonNull<IbvMr>,
    /// The address work requests use for its first byte (the address, or the IOVA).
    base: u64,
    bytes: u64,
    lkey: u32,
    rkey: u32,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("base", &format_args!("{:#x}", self.base))
            .field("bytes", &self.bytes)
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .finish_non_exhaustive()
    }
}

// SAFETY: see `Context`; the keys and bounds are plain values.
unsafe impl Send for MemoryRegion {}
// SAFETY: see `Context`.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// `ibv_reg_mr` of `[addr, addr + bytes)` with local write and remote write/read/atomic
    /// access. GPU memory needs the peer-memory module (`nvidia-peermem`) loaded.
    ///
    /// # Safety
    /// The range must stay mapped until the region is dropped, and it may be written by the
    /// NIC (peers' RDMA WRITEs) at any time while registered: nothing may rely on its contents
    /// not changing underneath.
    ///
    /// # Errors
    /// [`VerbsError::Call`] (`EFAULT` for an unmapped range, `ENOMEM` over the lock limit, …).
    pub unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: u64,
        bytes: u64,
    ) -> Result<MemoryRegion, VerbsError> {
        let len = usize::try_from(bytes).map_err(|_| VerbsError::Config {
            argument: "bytes",
            value: bytes.to_string(),
            rule: "must fit in usize",
        })?;
        let access = super::qp_state::REMOTE_ACCESS;
        // SAFETY: the protection domain is live; the caller guarantees the range (the kernel
        // pins it and checks that it is mapped).
        let ptr =
            unsafe { (pd.context.verbs.qp.reg_mr)(pd.ptr.as_ptr(), addr as *mut _, len, access) };
        MemoryRegion::wrap(pd, ptr, "ibv_reg_mr", addr, bytes)
    }

    /// `ibv_reg_dmabuf_mr`: `bytes` bytes at `offset` of the dma-buf `fd` (for example from
    /// `cuMemGetHandleForAddressRange`), addressed by work requests at `iova`.
    ///
    /// # Safety
    /// As [`MemoryRegion::register`]: the dma-buf must stay valid while registered, and may be
    /// written by peers at any time.
    ///
    /// # Errors
    /// [`VerbsError::DmabufUnsupported`] when the library lacks the call; [`VerbsError::Call`].
    pub unsafe fn register_dmabuf(
        pd: &Arc<ProtectionDomain>,
        fd: c_int,
        offset: u64,
        bytes: u64,
        iova: u64,
    ) -> Result<MemoryRegion, VerbsError> {
        let verbs = &pd.context.verbs;
        let Some(reg) = verbs.qp.reg_dmabuf_mr else {
            return Err(VerbsError::DmabufUnsupported {
                library: verbs.path().to_path_buf(),
            });
        };
        let len = usize::try_from(bytes).map_err(|_| VerbsError::Config {
            argument: "bytes",
            value: bytes.to_string(),
            rule: "must fit in usize",
        })?;
        let access = super::qp_state::REMOTE_ACCESS;
        // SAFETY: the protection domain is live; the caller guarantees the dma-buf.
        let ptr = unsafe { reg(pd.ptr.as_ptr(), offset, len, iova, fd, access) };
        MemoryRegion::wrap(pd, ptr, "ibv_reg_dmabuf_mr", iova, bytes)
    }

    fn wrap(
        pd: &Arc<ProtectionDomain>,
        ptr: *mut IbvMr,
        call: &'static str,
        base: u64,
        bytes: u64,
    ) -> Result<MemoryRegion, VerbsError> {
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| pd.context.call_error(call, io::Error::last_os_error()))?;
        // SAFETY: a non-NULL result of a registration call is a valid `ibv_mr`.
        let (lkey, rkey) = unsafe { ((*ptr.as_ptr()).lkey, (*ptr.as_ptr()).rkey) };
        Ok(MemoryRegion {
            pd: Arc::clone(pd),
            ptr,
            base,
            bytes,
            lkey,
            rkey,
        })
    }

    /// The address of the first byte as work requests see it.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Length in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Whether `[addr, addr + bytes)` lies inside the region.
    pub fn contains(&self, addr: u64, bytes: u64) -> bool {
        addr >= self.base
            && addr
                .checked_add(bytes)
                .is_some_and(|end| end <= self.base + self.bytes)
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered by `ibv_reg_mr`/`ibv_reg_dmabuf_mr`, deregistered once; the queue
        // pairs that used it are dropped first by the executor (field order).
        let _ = unsafe { (self.pd.context.verbs.qp.dereg_mr)(self.ptr.as_ptr()) };
    }
}

/// A completion queue, polled (no completion channel).
pub struct CompletionQueue {
    context: Arc<Context>,
    ptr: NonNull<IbvCq>,
    entries: usize,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("entries", &self.entries)
            .finish_non_exhaustive()
    }
}

// SAFETY: see `Context`.
unsafe impl Send for CompletionQueue {}
// SAFETY: see `Context`; `ibv_poll_cq` locks the queue in the provider.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// `ibv_create_cq` with at least `entries` entries.
    ///
    /// # Errors
    /// [`VerbsError::Config`] over `i32::MAX`; [`VerbsError::Call`] (more than the device's
    /// `max_cqe` is `EINVAL`).
    pub fn new(context: &Arc<Context>, entries: usize) -> Result<CompletionQueue, VerbsError> {
        let cqe = c_int::try_from(entries).map_err(|_| VerbsError::Config {
            argument: "completion queue entries",
            value: entries.to_string(),
            rule: "must fit in a C int",
        })?;
        // SAFETY: the context is open; no completion channel, vector 0.
        let ptr = unsafe {
            (context.verbs.qp.create_cq)(
                context.ptr.as_ptr(),
                cqe,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| context.call_error("ibv_create_cq", io::Error::last_os_error()))?;
        Ok(CompletionQueue {
            context: Arc::clone(context),
            ptr,
            entries,
        })
    }

    /// `ibv_poll_cq` (inline in verbs.h: the provider's `ops.poll_cq`): fills the front of
    /// `wcs`, returns how many.
    ///
    /// # Errors
    /// The negative return value; a provider without `poll_cq` is `-38` (`ENOSYS`).
    pub fn poll(&self, wcs: &mut [IbvWc]) -> Result<usize, i32> {
        let n = c_int::try_from(wcs.len()).unwrap_or(c_int::MAX);
        // SAFETY: the queue is live; its `context` points at the open `ibv_context` whose ops
        // table the provider filled at open time.
        let poll_cq = unsafe { (*(*self.ptr.as_ptr()).context).ops.poll_cq };
        let Some(poll_cq) = poll_cq else {
            return Err(-libc::ENOSYS);
        };
        // SAFETY: `wcs` has at least `n` entries; the queue is live.
        let rc = unsafe { poll_cq(self.ptr.as_ptr(), n, wcs.as_mut_ptr()) };
        usize::try_from(rc).map_err(|_| rc)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: created by `ibv_create_cq`, destroyed once, after the queue pairs using it
        // (they hold an `Arc` of it).
        let _ = unsafe { (self.context.verbs.qp.destroy_cq)(self.ptr.as_ptr()) };
    }
}

/// A reliable-connected queue pair whose sends complete on one completion queue.
pub struct QueuePair {
    pd: Arc<ProtectionDomain>,
    _cq: Arc<CompletionQueue>,
    ptr: NonNull<IbvQp>,
    cap: sys::IbvQpCap,
    wrs: Vec<sys::IbvSendWr>,
    sges: Vec<sys::IbvSge>,
    inline: Vec<[u8; INLINE_MAX]>,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.qpn())
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

// SAFETY: see `Context`; posting goes through `&mut self`.
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// `ibv_create_qp` of an RC queue pair with `send_depth` send requests, `max_inline`
    /// inline bytes, one scatter/gather entry, no receive queue to speak of (1 entry: some
    /// providers refuse 0), nothing signalled by default.
    ///
    /// # Errors
    /// [`VerbsError::Call`].
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        send_depth: u32,
        max_inline: u32,
    ) -> Result<QueuePair, VerbsError> {
        let mut init = sys::IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq.ptr.as_ptr(),
            recv_cq: cq.ptr.as_ptr(),
            srq: std::ptr::null_mut(),
            cap: sys::IbvQpCap {
                max_send_wr: send_depth,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: max_inline,
            },
            qp_type: sys::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the protection domain and completion queue are live; `init` is a valid
        // `ibv_qp_init_attr` the call updates with the capacities granted.
        let ptr = unsafe { (pd.context.verbs.qp.create_qp)(pd.ptr.as_ptr(), &mut init) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            pd.context
                .call_error("ibv_create_qp", io::Error::last_os_error())
        })?;
        Ok(QueuePair {
            pd: Arc::clone(pd),
            _cq: Arc::clone(cq),
            ptr,
            cap: init.cap,
            wrs: Vec::new(),
            sges: Vec::new(),
            inline: Vec::new(),
        })
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: the queue pair is live; `qp_num` is set at creation and never changes.
        unsafe { (*self.ptr.as_ptr()).qp_num }
    }

    /// The capacities granted.
    pub fn cap(&self) -> sys::IbvQpCap {
        self.cap
    }

    /// `ibv_modify_qp` with `t`'s attributes and mask.
    ///
    /// # Errors
    /// The `errno` value returned.
    pub fn modify(&mut self, t: &Transition) -> Result<(), io::Error> {
        let mut attr = t.attr;
        // SAFETY: the queue pair is live; `attr` is a valid `ibv_qp_attr` for `t.mask`.
        let rc =
            unsafe { (self.pd.context.verbs.qp.modify_qp)(self.ptr.as_ptr(), &mut attr, t.mask) };
        if rc == 0 { Ok(()) } else { Err(errno_of(rc)) }
    }
}

impl PostSink for QueuePair {
    /// `ibv_post_send` (inline in verbs.h: the provider's `ops.post_send`) of the chain as
    /// RDMA WRITEs.
    fn post(&mut self, chain: &[WorkRequest]) -> Result<(), String> {
        if chain.is_empty() {
            return Ok(());
        }
        self.inline.clear();
        self.inline.extend(chain.iter().map(|w| match w.payload {
            Payload::Inline { bytes, .. } => bytes,
            Payload::Gather { .. } => [0; INLINE_MAX],
        }));
        self.sges.clear();
        for (i, w) in chain.iter().enumerate() {
            self.sges.push(match w.payload {
                Payload::Gather { addr, len, lkey } => sys::IbvSge {
                    addr,
                    length: len,
                    lkey,
                },
                Payload::Inline { len, .. } => sys::IbvSge {
                    addr: self.inline[i].as_ptr() as u64,
                    length: u32::from(len),
                    lkey: 0,
                },
            });
        }
        self.wrs.clear();
        for (i, w) in chain.iter().enumerate() {
            let mut flags = 0;
            if w.signaled {
                flags |= sys::IBV_SEND_SIGNALED;
            }
            if matches!(w.payload, Payload::Inline { .. }) {
                flags |= sys::IBV_SEND_INLINE;
            }
            let mut wr = sys::IbvSendWr {
                wr_id: w.wr_id,
                sg_list: &mut self.sges[i],
                num_sge: 1,
                opcode: sys::IBV_WR_RDMA_WRITE,
                send_flags: flags,
                ..sys::IbvSendWr::default()
            };
            wr.rdma.remote_addr = w.remote_addr;
            wr.rdma.rkey = w.rkey;
            self.wrs.push(wr);
        }
        // Link the chain now that the vector no longer moves.
        // (Through the one raw pointer only, so no later borrow of the vector invalidates it.)
        let base = self.wrs.as_mut_ptr();
        for i in 0..self.wrs.len() - 1 {
            // SAFETY: `i + 1 < len`: both pointers are inside `self.wrs`, which is not touched
            // otherwise until the post returns.
            unsafe { (*base.add(i)).next = base.add(i + 1) };
        }
        // SAFETY: the queue pair is live; its `context` is the open context whose ops table
        // the provider filled.
        let post_send = unsafe { (*(*self.ptr.as_ptr()).context).ops.post_send };
        let Some(post_send) = post_send else {
            return Err("the provider has no post_send".to_string());
        };
        let mut bad: *mut sys::IbvSendWr = std::ptr::null_mut();
        // SAFETY: the chain, its scatter/gather entries and inline bytes live in `self` until
        // the call returns (inline data is copied by the call; gather entries name registered
        // memory); `bad` is a live out-pointer.
        let rc = unsafe { post_send(self.ptr.as_ptr(), base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let index = if bad.is_null() {
            0
        } else {
            // SAFETY: `bad` points into `self.wrs` (the provider returns the first refused
            // request of the chain it was given).
            usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
        };
        Err(format!(
            "{} (work request {index} of a chain of {})",
            errno_of(rc),
            chain.len()
        ))
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created by `ibv_create_qp`, destroyed once.
        let _ = unsafe { (self.pd.context.verbs.qp.destroy_qp)(self.ptr.as_ptr()) };
    }
}

/// `ibv_wc_status_str(status)`.
pub fn wc_status_str(verbs: &Verbs, status: u32) -> String {
    // SAFETY: the call returns a static string (or "unknown") for any value.
    let s = unsafe { (verbs.qp.wc_status_str)(status) };
    if s.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-NULL, NUL-terminated, static.
    unsafe { std::ffi::CStr::from_ptr(s) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::LibrarySearch;

    /// Where libibverbs is installed (with or without a device), every call of the queue-pair
    /// table resolves, and `ibv_wc_status_str` answers through it.
    #[test]
    fn system_library_resolves_the_queue_pair_calls() {
        let search = LibrarySearch {
            explicit: None,
            system_loader: true,
        };
        let Ok(verbs) = Verbs::load(&search) else {
            eprintln!("libibverbs not installed: nothing to resolve");
            return;
        };
        assert_eq!(wc_status_str(&verbs, sys::IBV_WC_SUCCESS), "success");
        // IBV_WC_WR_FLUSH_ERR = 5.
        assert_eq!(wc_status_str(&verbs, 5), "Work Request Flushed Error");
        eprintln!(
            "ibv_reg_dmabuf_mr: {}",
            if verbs.qp.reg_dmabuf_mr.is_some() {
                "present"
            } else {
                "absent (rdma-core < 34)"
            }
        );
    }
}
