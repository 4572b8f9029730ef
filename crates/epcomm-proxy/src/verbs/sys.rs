//! The raw C interface bound from `libibverbs.so.1` (rdma-core's `infiniband/verbs.h`, the
//! stable `IBVERBS_1.1` ABI; layouts checked against rdma-core 44 on x86_64): the device-list
//! calls, and what one reliable-connected (RC) queue pair needs. Every function is `unsafe` to
//! call; [`super::Verbs`] and the wrappers of `resources.rs` are the safe layer.
//!
//! Two calls of `verbs.h` are not symbols of the library:
//!
//! * `ibv_post_send` and `ibv_poll_cq` are `static inline` and call through the provider's
//!   table, `qp->context->ops.post_send` / `cq->context->ops.poll_cq`: hence the layouts of
//!   [`IbvContext`], [`IbvContextOps`], [`IbvQp`] and [`IbvCq`] here;
//! * `ibv_query_port` is a macro over the inline `___ibv_query_port`, which calls the
//!   extended context's `query_port` when the provider has one and otherwise the exported
//!   symbol `ibv_query_port@@IBVERBS_1.1`. That exported function takes the older
//!   `struct _compat_ibv_port_attr` (every field of [`IbvPortAttr`] up to `flags`, without
//!   `port_cap_flags2`) and fills exactly that many bytes after querying the provider into a
//!   full temporary. We call the exported symbol with a zeroed full [`IbvPortAttr`]: it
//!   writes the compatible prefix (state, MTUs, LID, link layer, …) and leaves
//!   `port_cap_flags2` zero, which nothing here reads.
//!
//! `ibv_reg_mr` is a macro too (`__ibv_reg_mr`, choosing `ibv_reg_mr_iova2` only for access
//! flags beyond the first generation); the exported `ibv_reg_mr` is the same call for the
//! flags used here (local write, remote write/read/atomic).

use std::os::raw::{c_char, c_int, c_uint, c_void};

/// `struct ibv_device`: opaque here (only pointers to it are handled).
#[repr(C)]
#[derive(Debug)]
pub struct IbvDevice {
    _opaque: [u8; 0],
}

/// `struct ibv_comp_channel`: opaque.
#[repr(C)]
#[derive(Debug)]
pub struct IbvCompChannel {
    _opaque: [u8; 0],
}

/// `struct ibv_srq`: opaque.
#[repr(C)]
#[derive(Debug)]
pub struct IbvSrq {
    _opaque: [u8; 0],
}

/// `pthread_mutex_t` on x86_64 glibc (40 bytes); only its size matters here.
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy)]
pub struct PthreadMutex {
    _bytes: [u8; 40],
}

/// `pthread_cond_t` on x86_64 glibc (48 bytes); only its size matters here.
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy)]
pub struct PthreadCond {
    _bytes: [u8; 48],
}

/// An entry of the ops table not called here: any function pointer has this size.
pub type OpaqueFn = Option<unsafe extern "C" fn()>;

/// `int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)`.
pub type PollCqFn =
    unsafe extern "C" fn(cq: *mut IbvCq, num_entries: c_int, wc: *mut IbvWc) -> c_int;
/// `int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr)`.
pub type PostSendFn =
    unsafe extern "C" fn(qp: *mut IbvQp, wr: *mut IbvSendWr, bad_wr: *mut *mut IbvSendWr) -> c_int;

/// `struct ibv_context_ops`: 32 function pointers; [`IbvContextOps::poll_cq`] (index 11) and
/// [`IbvContextOps::post_send`] (index 25) are the ones `verbs.h` inlines.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvContextOps {
    /// `_compat_query_device` … `dealloc_mw`, `_compat_create_cq` (11 entries).
    pub _before_poll_cq: [OpaqueFn; 11],
    /// `poll_cq`.
    pub poll_cq: Option<PollCqFn>,
    /// `req_notify_cq` … `_compat_destroy_qp` (13 entries).
    pub _before_post_send: [OpaqueFn; 13],
    /// `post_send`.
    pub post_send: Option<PostSendFn>,
    /// `post_recv` … `_compat_async_event` (6 entries).
    pub _after_post_send: [OpaqueFn; 6],
}

/// `struct ibv_context`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvContext {
    /// The device.
    pub device: *mut IbvDevice,
    /// The provider's table.
    pub ops: IbvContextOps,
    /// Command file descriptor.
    pub cmd_fd: c_int,
    /// Asynchronous event file descriptor.
    pub async_fd: c_int,
    /// Completion vectors.
    pub num_comp_vectors: c_int,
    /// Library lock.
    pub mutex: PthreadMutex,
    /// `__VERBS_ABI_IS_EXTENDED` for an extended context.
    pub abi_compat: *mut c_void,
}

/// `struct ibv_pd`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvPd {
    /// Its context.
    pub context: *mut IbvContext,
    /// Kernel handle.
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvMr {
    /// Its context.
    pub context: *mut IbvContext,
    /// Its protection domain.
    pub pd: *mut IbvPd,
    /// Start of the region (the IOVA for a dma-buf registration).
    pub addr: *mut c_void,
    /// Length in bytes.
    pub length: usize,
    /// Kernel handle.
    pub handle: u32,
    /// Local key (scatter/gather entries).
    pub lkey: u32,
    /// Remote key (what peers put in their work requests).
    pub rkey: u32,
}

/// `struct ibv_cq`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvCq {
    /// Its context (whose `ops.poll_cq` polls it).
    pub context: *mut IbvContext,
    /// Completion channel, if any.
    pub channel: *mut IbvCompChannel,
    /// User context.
    pub cq_context: *mut c_void,
    /// Kernel handle.
    pub handle: u32,
    /// Entries (at least the number asked for).
    pub cqe: c_int,
    /// Library lock.
    pub mutex: PthreadMutex,
    /// Library condition.
    pub cond: PthreadCond,
    /// Events acknowledged.
    pub comp_events_completed: u32,
    /// Events acknowledged.
    pub async_events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvQp {
    /// Its context (whose `ops.post_send` posts to it).
    pub context: *mut IbvContext,
    /// User context.
    pub qp_context: *mut c_void,
    /// Protection domain.
    pub pd: *mut IbvPd,
    /// Send completion queue.
    pub send_cq: *mut IbvCq,
    /// Receive completion queue.
    pub recv_cq: *mut IbvCq,
    /// Shared receive queue, if any.
    pub srq: *mut IbvSrq,
    /// Kernel handle.
    pub handle: u32,
    /// Queue pair number (what the peer connects to).
    pub qp_num: u32,
    /// `enum ibv_qp_state`.
    pub state: c_uint,
    /// `enum ibv_qp_type`.
    pub qp_type: c_uint,
    /// Library lock.
    pub mutex: PthreadMutex,
    /// Library condition.
    pub cond: PthreadCond,
    /// Events acknowledged.
    pub events_completed: u32,
}

/// `union ibv_gid`: 16 bytes, 8-byte aligned (its `global` view is two `__be64`).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvGid {
    /// The GID in network byte order.
    pub raw: [u8; 16],
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvGlobalRoute {
    /// Destination GID.
    pub dgid: IbvGid,
    /// Flow label.
    pub flow_label: u32,
    /// Source GID index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvAhAttr {
    /// Global route (used when `is_global`).
    pub grh: IbvGlobalRoute,
    /// Destination LID (InfiniBand).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub src_path_bits: u8,
    /// Static rate.
    pub static_rate: u8,
    /// Whether `grh` is used (required on RoCE).
    pub is_global: u8,
    /// Local port.
    pub port_num: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvQpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive.
    pub max_recv_sge: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvQpInitAttr {
    /// User context.
    pub qp_context: *mut c_void,
    /// Send completion queue.
    pub send_cq: *mut IbvCq,
    /// Receive completion queue.
    pub recv_cq: *mut IbvCq,
    /// Shared receive queue.
    pub srq: *mut IbvSrq,
    /// Capacities asked for; the call writes the ones granted.
    pub cap: IbvQpCap,
    /// `enum ibv_qp_type` ([`IBV_QPT_RC`]).
    pub qp_type: c_uint,
    /// Non-zero: every send is signalled.
    pub sq_sig_all: c_int,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvQpAttr {
    /// `enum ibv_qp_state`: the state to move to.
    pub qp_state: c_uint,
    /// `enum ibv_qp_state`.
    pub cur_qp_state: c_uint,
    /// `enum ibv_mtu`.
    pub path_mtu: c_uint,
    /// `enum ibv_mig_state`.
    pub path_mig_state: c_uint,
    /// Q_Key (UD).
    pub qkey: u32,
    /// Receive packet sequence number.
    pub rq_psn: u32,
    /// Send packet sequence number.
    pub sq_psn: u32,
    /// The peer's queue pair number.
    pub dest_qp_num: u32,
    /// `enum ibv_access_flags` for incoming operations.
    pub qp_access_flags: c_uint,
    /// Capacities.
    pub cap: IbvQpCap,
    /// Primary path.
    pub ah_attr: IbvAhAttr,
    /// Alternate path.
    pub alt_ah_attr: IbvAhAttr,
    /// P_Key index.
    pub pkey_index: u16,
    /// Alternate P_Key index.
    pub alt_pkey_index: u16,
    /// SQD notification.
    pub en_sqd_async_notify: u8,
    /// SQ draining (query only).
    pub sq_draining: u8,
    /// Outstanding RDMA reads/atomics as initiator.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA reads/atomics as responder.
    pub max_dest_rd_atomic: u8,
    /// Minimum RNR NAK timer.
    pub min_rnr_timer: u8,
    /// Local port.
    pub port_num: u8,
    /// Local ACK timeout (4.096 µs · 2^timeout).
    pub timeout: u8,
    /// Retries on timeout.
    pub retry_cnt: u8,
    /// Retries on RNR NAK (7 = infinite).
    pub rnr_retry: u8,
    /// Alternate port.
    pub alt_port_num: u8,
    /// Alternate timeout.
    pub alt_timeout: u8,
    /// Rate limit (kbps).
    pub rate_limit: u32,
}

/// `struct ibv_port_attr` (see the [module docs](self) for how it is filled).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvPortAttr {
    /// `enum ibv_port_state`.
    pub state: c_uint,
    /// `enum ibv_mtu`.
    pub max_mtu: c_uint,
    /// `enum ibv_mtu`.
    pub active_mtu: c_uint,
    /// GID table length.
    pub gid_tbl_len: c_int,
    /// Capability flags.
    pub port_cap_flags: u32,
    /// Largest message.
    pub max_msg_sz: u32,
    /// Counter.
    pub bad_pkey_cntr: u32,
    /// Counter.
    pub qkey_viol_cntr: u32,
    /// P_Key table length.
    pub pkey_tbl_len: u16,
    /// Base LID (InfiniBand).
    pub lid: u16,
    /// Subnet manager's LID.
    pub sm_lid: u16,
    /// LMC.
    pub lmc: u8,
    /// VLs.
    pub max_vl_num: u8,
    /// SM service level.
    pub sm_sl: u8,
    /// Subnet timeout.
    pub subnet_timeout: u8,
    /// Init type reply.
    pub init_type_reply: u8,
    /// Width.
    pub active_width: u8,
    /// Speed.
    pub active_speed: u8,
    /// Physical state.
    pub phys_state: u8,
    /// [`IBV_LINK_LAYER_INFINIBAND`] or [`IBV_LINK_LAYER_ETHERNET`].
    pub link_layer: u8,
    /// Flags.
    pub flags: u8,
    /// More capability flags (not written by the compatible `ibv_query_port`).
    pub port_cap_flags2: u16,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvSge {
    /// Local address.
    pub addr: u64,
    /// Bytes.
    pub length: u32,
    /// The region's local key.
    pub lkey: u32,
}

/// The `wr.rdma` / `wr.atomic` / `wr.ud` union of `struct ibv_send_wr`, seen as its `rdma`
/// member plus padding to the union's 32 bytes (`atomic` is the largest member).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvRdmaWr {
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key (`wr.rdma.rkey`); for atomics `compare_add`'s low half starts here.
    pub rkey: u32,
    _pad: u32,
    _rest: [u64; 2],
}

/// `struct ibv_send_wr`, for RDMA WRITE (the fields after `wr` are zero).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvSendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The next request of a chain, or `NULL`.
    pub next: *mut IbvSendWr,
    /// Scatter/gather list.
    pub sg_list: *mut IbvSge,
    /// Entries in `sg_list`.
    pub num_sge: c_int,
    /// `enum ibv_wr_opcode`.
    pub opcode: c_uint,
    /// `enum ibv_send_flags`.
    pub send_flags: c_uint,
    /// Immediate data (network order) / rkey to invalidate.
    pub imm_data: u32,
    /// `wr.rdma`.
    pub rdma: IbvRdmaWr,
    /// `qp_type.xrc.remote_srqn` (4 bytes, padded to 8).
    pub _qp_type: u64,
    /// The `bind_mw` / `tso` union (48 bytes).
    pub _bind_mw: [u64; 6],
}

impl Default for IbvSendWr {
    fn default() -> IbvSendWr {
        IbvSendWr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            rdma: IbvRdmaWr::default(),
            _qp_type: 0,
            _bind_mw: [0; 6],
        }
    }
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvWc {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// `enum ibv_wc_status` ([`IBV_WC_SUCCESS`] = 0).
    pub status: c_uint,
    /// `enum ibv_wc_opcode` (valid only on success).
    pub opcode: c_uint,
    /// Vendor error syndrome.
    pub vendor_err: u32,
    /// Bytes (receives).
    pub byte_len: u32,
    /// Immediate data / invalidated rkey.
    pub imm_data: u32,
    /// The local queue pair.
    pub qp_num: u32,
    /// Source queue pair (UD).
    pub src_qp: u32,
    /// `enum ibv_wc_flags`.
    pub wc_flags: c_uint,
    /// P_Key index.
    pub pkey_index: u16,
    /// Source LID.
    pub slid: u16,
    /// Service level.
    pub sl: u8,
    /// Path bits.
    pub dlid_path_bits: u8,
}

// Constants of verbs.h.

/// `IBV_QPT_RC`.
pub const IBV_QPT_RC: c_uint = 2;
/// `IBV_QPS_RESET`.
pub const IBV_QPS_RESET: c_uint = 0;
/// `IBV_QPS_INIT`.
pub const IBV_QPS_INIT: c_uint = 1;
/// `IBV_QPS_RTR`.
pub const IBV_QPS_RTR: c_uint = 2;
/// `IBV_QPS_RTS`.
pub const IBV_QPS_RTS: c_uint = 3;

/// `enum ibv_qp_attr_mask`: `IBV_QP_STATE`.
pub const IBV_QP_STATE: c_int = 1 << 0;
/// `IBV_QP_ACCESS_FLAGS`.
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
/// `IBV_QP_PKEY_INDEX`.
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
/// `IBV_QP_PORT`.
pub const IBV_QP_PORT: c_int = 1 << 5;
/// `IBV_QP_AV`.
pub const IBV_QP_AV: c_int = 1 << 7;
/// `IBV_QP_PATH_MTU`.
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
/// `IBV_QP_TIMEOUT`.
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
/// `IBV_QP_RETRY_CNT`.
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
/// `IBV_QP_RNR_RETRY`.
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
/// `IBV_QP_RQ_PSN`.
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
/// `IBV_QP_MAX_QP_RD_ATOMIC`.
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
/// `IBV_QP_MIN_RNR_TIMER`.
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
/// `IBV_QP_SQ_PSN`.
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
/// `IBV_QP_MAX_DEST_RD_ATOMIC`.
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
/// `IBV_QP_DEST_QPN`.
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

/// `IBV_ACCESS_LOCAL_WRITE`.
pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
/// `IBV_ACCESS_REMOTE_WRITE`.
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;
/// `IBV_ACCESS_REMOTE_READ`.
pub const IBV_ACCESS_REMOTE_READ: c_int = 1 << 2;
/// `IBV_ACCESS_REMOTE_ATOMIC`.
pub const IBV_ACCESS_REMOTE_ATOMIC: c_int = 1 << 3;

/// `IBV_WR_RDMA_WRITE`.
pub const IBV_WR_RDMA_WRITE: c_uint = 0;
/// `IBV_SEND_SIGNALED`.
pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;
/// `IBV_SEND_INLINE`.
pub const IBV_SEND_INLINE: c_uint = 1 << 3;

/// `IBV_WC_SUCCESS`.
pub const IBV_WC_SUCCESS: c_uint = 0;

/// `IBV_PORT_ACTIVE`.
pub const IBV_PORT_ACTIVE: c_uint = 4;
/// `IBV_LINK_LAYER_INFINIBAND`.
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
/// `IBV_LINK_LAYER_ETHERNET`.
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

// Function types, one per symbol.

/// `struct ibv_device **ibv_get_device_list(int *num_devices)`: a `NULL`-terminated array of
/// `*num_devices` devices, or `NULL` with `errno` set.
pub type GetDeviceList = unsafe extern "C" fn(num_devices: *mut c_int) -> *mut *mut IbvDevice;
/// `void ibv_free_device_list(struct ibv_device **list)`.
pub type FreeDeviceList = unsafe extern "C" fn(list: *mut *mut IbvDevice);
/// `const char *ibv_get_device_name(struct ibv_device *device)`.
pub type GetDeviceName = unsafe extern "C" fn(device: *mut IbvDevice) -> *const c_char;
/// `__be64 ibv_get_device_guid(struct ibv_device *device)`: the GUID in network byte order.
pub type GetDeviceGuid = unsafe extern "C" fn(device: *mut IbvDevice) -> u64;
/// `struct ibv_context *ibv_open_device(struct ibv_device *device)`: `NULL` with `errno`.
pub type OpenDevice = unsafe extern "C" fn(device: *mut IbvDevice) -> *mut IbvContext;
/// `int ibv_close_device(struct ibv_context *context)`.
pub type CloseDevice = unsafe extern "C" fn(context: *mut IbvContext) -> c_int;
/// `int ibv_query_port(struct ibv_context *, uint8_t port_num, struct _compat_ibv_port_attr *)`
/// (the exported symbol; see the [module docs](self)).
pub type QueryPort =
    unsafe extern "C" fn(context: *mut IbvContext, port_num: u8, attr: *mut IbvPortAttr) -> c_int;
/// `int ibv_query_gid(struct ibv_context *, uint8_t port_num, int index, union ibv_gid *gid)`.
pub type QueryGid = unsafe extern "C" fn(
    context: *mut IbvContext,
    port_num: u8,
    index: c_int,
    gid: *mut IbvGid,
) -> c_int;
/// `struct ibv_pd *ibv_alloc_pd(struct ibv_context *context)`.
pub type AllocPd = unsafe extern "C" fn(context: *mut IbvContext) -> *mut IbvPd;
/// `int ibv_dealloc_pd(struct ibv_pd *pd)`.
pub type DeallocPd = unsafe extern "C" fn(pd: *mut IbvPd) -> c_int;
/// `struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access)`.
pub type RegMr = unsafe extern "C" fn(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut IbvMr;
/// `struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
/// uint64_t iova, int fd, int access)` (rdma-core ≥ 34; optional here).
pub type RegDmabufMr = unsafe extern "C" fn(
    pd: *mut IbvPd,
    offset: u64,
    length: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut IbvMr;
/// `int ibv_dereg_mr(struct ibv_mr *mr)`.
pub type DeregMr = unsafe extern "C" fn(mr: *mut IbvMr) -> c_int;
/// `struct ibv_cq *ibv_create_cq(struct ibv_context *, int cqe, void *cq_context,
/// struct ibv_comp_channel *channel, int comp_vector)`.
pub type CreateCq = unsafe extern "C" fn(
    context: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut IbvCompChannel,
    comp_vector: c_int,
) -> *mut IbvCq;
/// `int ibv_destroy_cq(struct ibv_cq *cq)`.
pub type DestroyCq = unsafe extern "C" fn(cq: *mut IbvCq) -> c_int;
/// `struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr)`.
pub type CreateQp = unsafe extern "C" fn(pd: *mut IbvPd, attr: *mut IbvQpInitAttr) -> *mut IbvQp;
/// `int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask)`: 0, or an
/// `errno` value.
pub type ModifyQp =
    unsafe extern "C" fn(qp: *mut IbvQp, attr: *mut IbvQpAttr, attr_mask: c_int) -> c_int;
/// `int ibv_destroy_qp(struct ibv_qp *qp)`.
pub type DestroyQp = unsafe extern "C" fn(qp: *mut IbvQp) -> c_int;
/// `const char *ibv_wc_status_str(enum ibv_wc_status status)`.
pub type WcStatusStr = unsafe extern "C" fn(status: c_uint) -> *const c_char;

/// Symbol names, NUL-terminated for `dlsym`.
pub const SYM_GET_DEVICE_LIST: &[u8] = b"ibv_get_device_list\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_FREE_DEVICE_LIST: &[u8] = b"ibv_free_device_list\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_GET_DEVICE_NAME: &[u8] = b"ibv_get_device_name\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_GET_DEVICE_GUID: &[u8] = b"ibv_get_device_guid\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_OPEN_DEVICE: &[u8] = b"ibv_open_device\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_CLOSE_DEVICE: &[u8] = b"ibv_close_device\0";
/// See [`SYM_GET_DEVICE_LIST`] and the [module docs](self).
pub const SYM_QUERY_PORT: &[u8] = b"ibv_query_port\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_QUERY_GID: &[u8] = b"ibv_query_gid\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_ALLOC_PD: &[u8] = b"ibv_alloc_pd\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_DEALLOC_PD: &[u8] = b"ibv_dealloc_pd\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_REG_MR: &[u8] = b"ibv_reg_mr\0";
/// See [`SYM_GET_DEVICE_LIST`] (optional: absent before rdma-core 34).
pub const SYM_REG_DMABUF_MR: &[u8] = b"ibv_reg_dmabuf_mr\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_DEREG_MR: &[u8] = b"ibv_dereg_mr\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_CREATE_CQ: &[u8] = b"ibv_create_cq\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_DESTROY_CQ: &[u8] = b"ibv_destroy_cq\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_CREATE_QP: &[u8] = b"ibv_create_qp\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_MODIFY_QP: &[u8] = b"ibv_modify_qp\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_DESTROY_QP: &[u8] = b"ibv_destroy_qp\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_WC_STATUS_STR: &[u8] = b"ibv_wc_status_str\0";

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod layout {
    //! Sizes and offsets printed by a C program including rdma-core 44's `infiniband/verbs.h`
    //! (Debian 12 `libibverbs-dev`, gcc, x86_64).

    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn context_and_ops_table() {
        assert_eq!(size_of::<IbvContextOps>(), 256);
        assert_eq!(offset_of!(IbvContextOps, poll_cq), 88);
        assert_eq!(offset_of!(IbvContextOps, post_send), 200);
        assert_eq!(size_of::<IbvContext>(), 328);
        assert_eq!(offset_of!(IbvContext, ops), 8);
        assert_eq!(offset_of!(IbvContext, cmd_fd), 264);
        assert_eq!(offset_of!(IbvContext, mutex), 280);
        assert_eq!(offset_of!(IbvContext, abi_compat), 320);
    }

    #[test]
    fn pd_mr_cq_qp() {
        assert_eq!(size_of::<IbvPd>(), 16);
        assert_eq!(offset_of!(IbvPd, handle), 8);
        assert_eq!(size_of::<IbvMr>(), 48);
        assert_eq!(offset_of!(IbvMr, addr), 16);
        assert_eq!(offset_of!(IbvMr, length), 24);
        assert_eq!(offset_of!(IbvMr, lkey), 36);
        assert_eq!(offset_of!(IbvMr, rkey), 40);
        assert_eq!(size_of::<IbvCq>(), 128);
        assert_eq!(offset_of!(IbvCq, cqe), 28);
        assert_eq!(offset_of!(IbvCq, mutex), 32);
        assert_eq!(offset_of!(IbvCq, cond), 72);
        assert_eq!(offset_of!(IbvCq, comp_events_completed), 120);
        assert_eq!(size_of::<IbvQp>(), 160);
        assert_eq!(offset_of!(IbvQp, handle), 48);
        assert_eq!(offset_of!(IbvQp, qp_num), 52);
        assert_eq!(offset_of!(IbvQp, state), 56);
        assert_eq!(offset_of!(IbvQp, qp_type), 60);
        assert_eq!(offset_of!(IbvQp, mutex), 64);
        assert_eq!(offset_of!(IbvQp, cond), 104);
        assert_eq!(offset_of!(IbvQp, events_completed), 152);
    }

    #[test]
    fn work_requests_and_completions() {
        assert_eq!(size_of::<IbvSge>(), 16);
        assert_eq!(offset_of!(IbvSge, lkey), 12);
        assert_eq!(size_of::<IbvSendWr>(), 128);
        assert_eq!(align_of::<IbvSendWr>(), 8);
        assert_eq!(offset_of!(IbvSendWr, next), 8);
        assert_eq!(offset_of!(IbvSendWr, sg_list), 16);
        assert_eq!(offset_of!(IbvSendWr, num_sge), 24);
        assert_eq!(offset_of!(IbvSendWr, opcode), 28);
        assert_eq!(offset_of!(IbvSendWr, send_flags), 32);
        assert_eq!(offset_of!(IbvSendWr, imm_data), 36);
        assert_eq!(offset_of!(IbvSendWr, rdma), 40);
        assert_eq!(
            offset_of!(IbvSendWr, rdma) + offset_of!(IbvRdmaWr, rkey),
            48
        );
        assert_eq!(size_of::<IbvRdmaWr>(), 32);
        assert_eq!(offset_of!(IbvSendWr, _qp_type), 72);
        assert_eq!(offset_of!(IbvSendWr, _bind_mw), 80);
        assert_eq!(size_of::<IbvWc>(), 48);
        assert_eq!(offset_of!(IbvWc, status), 8);
        assert_eq!(offset_of!(IbvWc, opcode), 12);
        assert_eq!(offset_of!(IbvWc, vendor_err), 16);
        assert_eq!(offset_of!(IbvWc, byte_len), 20);
        assert_eq!(offset_of!(IbvWc, qp_num), 28);
        assert_eq!(offset_of!(IbvWc, src_qp), 32);
        assert_eq!(offset_of!(IbvWc, wc_flags), 36);
        assert_eq!(offset_of!(IbvWc, pkey_index), 40);
        assert_eq!(offset_of!(IbvWc, slid), 42);
        assert_eq!(offset_of!(IbvWc, sl), 44);
        assert_eq!(offset_of!(IbvWc, dlid_path_bits), 45);
    }

    #[test]
    fn queue_pair_attributes() {
        assert_eq!(size_of::<IbvGid>(), 16);
        assert_eq!(align_of::<IbvGid>(), 8);
        assert_eq!(size_of::<IbvQpCap>(), 20);
        assert_eq!(size_of::<IbvQpInitAttr>(), 64);
        assert_eq!(offset_of!(IbvQpInitAttr, send_cq), 8);
        assert_eq!(offset_of!(IbvQpInitAttr, cap), 32);
        assert_eq!(offset_of!(IbvQpInitAttr, qp_type), 52);
        assert_eq!(offset_of!(IbvQpInitAttr, sq_sig_all), 56);
        assert_eq!(size_of::<IbvGlobalRoute>(), 24);
        assert_eq!(offset_of!(IbvGlobalRoute, flow_label), 16);
        assert_eq!(offset_of!(IbvGlobalRoute, sgid_index), 20);
        assert_eq!(offset_of!(IbvGlobalRoute, hop_limit), 21);
        assert_eq!(offset_of!(IbvGlobalRoute, traffic_class), 22);
        assert_eq!(size_of::<IbvAhAttr>(), 32);
        assert_eq!(offset_of!(IbvAhAttr, dlid), 24);
        assert_eq!(offset_of!(IbvAhAttr, sl), 26);
        assert_eq!(offset_of!(IbvAhAttr, is_global), 29);
        assert_eq!(offset_of!(IbvAhAttr, port_num), 30);
        assert_eq!(size_of::<IbvQpAttr>(), 144);
        assert_eq!(offset_of!(IbvQpAttr, qkey), 16);
        assert_eq!(offset_of!(IbvQpAttr, rq_psn), 20);
        assert_eq!(offset_of!(IbvQpAttr, sq_psn), 24);
        assert_eq!(offset_of!(IbvQpAttr, dest_qp_num), 28);
        assert_eq!(offset_of!(IbvQpAttr, qp_access_flags), 32);
        assert_eq!(offset_of!(IbvQpAttr, cap), 36);
        assert_eq!(offset_of!(IbvQpAttr, ah_attr), 56);
        assert_eq!(offset_of!(IbvQpAttr, alt_ah_attr), 88);
        assert_eq!(offset_of!(IbvQpAttr, pkey_index), 120);
        assert_eq!(offset_of!(IbvQpAttr, max_rd_atomic), 126);
        assert_eq!(offset_of!(IbvQpAttr, max_dest_rd_atomic), 127);
        assert_eq!(offset_of!(IbvQpAttr, min_rnr_timer), 128);
        assert_eq!(offset_of!(IbvQpAttr, port_num), 129);
        assert_eq!(offset_of!(IbvQpAttr, timeout), 130);
        assert_eq!(offset_of!(IbvQpAttr, retry_cnt), 131);
        assert_eq!(offset_of!(IbvQpAttr, rnr_retry), 132);
        assert_eq!(offset_of!(IbvQpAttr, alt_timeout), 134);
        assert_eq!(offset_of!(IbvQpAttr, rate_limit), 136);
    }

    #[test]
    fn port_attributes() {
        assert_eq!(size_of::<IbvPortAttr>(), 52);
        assert_eq!(offset_of!(IbvPortAttr, state), 0);
        assert_eq!(offset_of!(IbvPortAttr, active_mtu), 8);
        assert_eq!(offset_of!(IbvPortAttr, gid_tbl_len), 12);
        assert_eq!(offset_of!(IbvPortAttr, max_msg_sz), 20);
        assert_eq!(offset_of!(IbvPortAttr, lid), 34);
        assert_eq!(offset_of!(IbvPortAttr, link_layer), 46);
        assert_eq!(offset_of!(IbvPortAttr, flags), 47);
        assert_eq!(offset_of!(IbvPortAttr, port_cap_flags2), 48);
    }
}
