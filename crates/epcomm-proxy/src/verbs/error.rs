//! [`LoadError`] (finding and opening the library) and [`DeviceError`] (listing devices).

use std::fmt;
use std::path::PathBuf;

use super::{ENV_EPCOMM_IBVERBS_LIB, LIBRARY_NAME, Origin};

/// One place looked at, and why it was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Searched {
    /// The step.
    pub origin: Origin,
    /// The file (or soname) tried.
    pub path: PathBuf,
    /// Why it was not used: `no such file`, the dynamic loader's error, ….
    pub outcome: String,
}

impl fmt::Display for Searched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} ({})",
            self.origin,
            self.path.display(),
            self.outcome
        )
    }
}

fn bullets(searched: &[Searched]) -> String {
    if searched.is_empty() {
        return "  (no place to look: the search was empty)".to_string();
    }
    searched
        .iter()
        .map(|s| format!("  - {s}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Finding or opening `libibverbs.so.1` failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// No place of the search has the library.
    #[error(
        "{library} (rdma-core's verbs library) was not found. Searched, in order:\n{}\n\
         Install it (Debian/Ubuntu: apt-get install libibverbs1 ibverbs-providers; Fedora: \
         dnf install libibverbs) or point {ENV_EPCOMM_IBVERBS_LIB} at the file or its directory",
        bullets(searched),
        library = LIBRARY_NAME
    )]
    NotFound {
        /// Every place looked at, in order.
        searched: Vec<Searched>,
    },
    /// A file exists but `dlopen` refused it.
    #[error("dlopen({}) failed: {source}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The loader's error.
        source: libloading::Error,
    },
    /// The library lacks a symbol bound here.
    #[error("{} lacks {symbol}: {source}", path.display())]
    MissingSymbol {
        /// The file.
        path: PathBuf,
        /// The symbol.
        symbol: &'static str,
        /// The loader's error.
        source: libloading::Error,
    },
}

/// Listing the RDMA devices failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// No RDMA device exists on this machine.
    #[error("no RDMA device: {reason} (libibverbs: {})", library.display())]
    NoDevice {
        /// The library asked.
        library: PathBuf,
        /// What it said.
        reason: String,
    },
    /// `ibv_get_device_list` failed otherwise.
    #[error("ibv_get_device_list failed (libibverbs: {}): {source}", library.display())]
    ListFailed {
        /// The library asked.
        library: PathBuf,
        /// `errno`.
        source: std::io::Error,
    },
    /// A device has no name (`ibv_get_device_name` returned `NULL`).
    #[error("RDMA device {index} has no name (libibverbs: {})", library.display())]
    Unnamed {
        /// The library asked.
        library: PathBuf,
        /// Its index in the list.
        index: usize,
    },
}

/// Setting up the verbs executor failed (device, port, GID, protection domain, memory
/// registration, queues, connection).
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// `libibverbs.so.1` could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// This machine has no RDMA device.
    #[error("no RDMA device: {reason} (libibverbs: {})", library.display())]
    NoDevice {
        /// The library asked.
        library: PathBuf,
        /// What it said.
        reason: String,
    },
    /// Listing the devices failed otherwise.
    #[error(transparent)]
    Devices(DeviceError),
    /// `device` named a device that does not exist.
    #[error("RDMA device `{name}` (argument `device`) does not exist; devices: {}", available.join(", "))]
    DeviceNotFound {
        /// The name asked for.
        name: String,
        /// The devices found.
        available: Vec<String>,
    },
    /// No port of the devices considered is active.
    #[error("no active port: {}", tried.join("; "))]
    NoActivePort {
        /// `device:port (state)` for each port looked at.
        tried: Vec<String>,
    },
    /// The port asked for is not active.
    #[error(
        "port {port} of RDMA device `{device}` (argument `port`) is not active (state {state})"
    )]
    PortNotActive {
        /// The device.
        device: String,
        /// The port.
        port: u8,
        /// `enum ibv_port_state`.
        state: u32,
    },
    /// No GID matches the selector.
    #[error("RDMA device `{device}` port {port}: no GID for `gid` = {selector}: {reason}")]
    NoGid {
        /// The device.
        device: String,
        /// The port.
        port: u8,
        /// The selector, as written.
        selector: String,
        /// Why none matched.
        reason: String,
    },
    /// A verbs call failed.
    #[error("{call} failed on RDMA device `{device}`: {source}")]
    Call {
        /// The call (`ibv_open_device`, `ibv_reg_mr`, …).
        call: &'static str,
        /// The device.
        device: String,
        /// `errno`.
        source: std::io::Error,
    },
    /// The library lacks `ibv_reg_dmabuf_mr` (rdma-core older than 34).
    #[error(
        "heap = DmaBuf needs ibv_reg_dmabuf_mr, which {} lacks (rdma-core >= 34 has it)",
        library.display()
    )]
    DmabufUnsupported {
        /// The library.
        library: PathBuf,
    },
    /// Moving a queue pair to the next state failed.
    #[error(
        "ibv_modify_qp {from} -> {to} (attribute mask {mask:#x}) failed for the queue pair to \
         peer {peer}: {source}"
    )]
    ModifyQp {
        /// The peer the queue pair connects to.
        peer: u32,
        /// The state before.
        from: &'static str,
        /// The state asked for.
        to: &'static str,
        /// The attribute mask passed.
        mask: i32,
        /// The error returned.
        source: std::io::Error,
    },
    /// A configuration value breaks a rule.
    #[error("verbs executor argument `{argument}` is {value}: {rule}")]
    Config {
        /// The argument.
        argument: &'static str,
        /// Its value.
        value: String,
        /// The rule broken.
        rule: &'static str,
    },
    /// A peer's connection information is unusable.
    #[error(transparent)]
    Endpoint(#[from] super::endpoint::EndpointError),
    /// The caller's all-gather failed.
    #[error("exchanging queue pair endpoints through the bootstrap all-gather failed: {source}")]
    Bootstrap {
        /// The bootstrap's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl From<DeviceError> for VerbsError {
    fn from(e: DeviceError) -> VerbsError {
        match e {
            DeviceError::NoDevice { library, reason } => VerbsError::NoDevice { library, reason },
            other => VerbsError::Devices(other),
        }
    }
}

/// One operation of the verbs executor failed (the `reason` of an
/// [`OpFailure`](crate::executor::OpFailure)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsOpError {
    /// The source address of a transfer is outside every registered region.
    #[error(
        "transfer to peer {peer}: source address {address:#x} + {bytes} bytes is outside every \
         registered region ({regions})"
    )]
    SourceNotRegistered {
        /// The destination peer.
        peer: u32,
        /// The source address.
        address: u64,
        /// Its length.
        bytes: u64,
        /// The registered regions, `[start, end)`.
        regions: String,
    },
    /// A range does not fit in the symmetric buffer.
    #[error(
        "{what} to peer {peer}: [{offset}, {offset} + {bytes}) must fit in the {heap_bytes}-byte \
         symmetric buffer"
    )]
    OutOfBounds {
        /// `transfer destination`, `transfer source`, `signal`, `write`.
        what: &'static str,
        /// The peer.
        peer: u32,
        /// The offset.
        offset: u64,
        /// The length.
        bytes: u64,
        /// The buffer's size.
        heap_bytes: u64,
    },
    /// The peer is not one of the world.
    #[error("peer {peer} is out of range: the world has {world} ranks")]
    PeerOutOfRange {
        /// The peer.
        peer: u32,
        /// The world size.
        world: u32,
    },
    /// An operation (a transfer; a write's elements or a signal's words, inline) needs more
    /// work requests than the send queue holds.
    #[error(
        "an operation of {bytes} bytes to peer {peer} needs {needed} work requests of at most \
         {chunk} bytes; the send queue holds {depth} (raise `send_queue_depth`)"
    )]
    TooLarge {
        /// The peer.
        peer: u32,
        /// Bytes.
        bytes: u64,
        /// Work requests needed.
        needed: u64,
        /// Bytes per work request.
        chunk: u64,
        /// Send queue depth.
        depth: usize,
    },
    /// `ibv_post_send` refused a chain.
    #[error("ibv_post_send to peer {peer} failed: {message}")]
    PostSend {
        /// The peer.
        peer: u32,
        /// The error (`errno` text).
        message: String,
    },
    /// `ibv_poll_cq` failed.
    #[error("ibv_poll_cq failed: returned {code}")]
    PollCq {
        /// Its return value.
        code: i32,
    },
    /// A work completion failed.
    #[error(
        "{opcode} to peer {peer} failed: {status_str} (ibv_wc_status {status}, vendor error \
         {vendor_err:#x})"
    )]
    Completion {
        /// The peer.
        peer: u32,
        /// What the work request was (`RDMA WRITE`, `RDMA WRITE inline (signal add)`, …).
        opcode: &'static str,
        /// `enum ibv_wc_status`.
        status: u32,
        /// `ibv_wc_status_str(status)`.
        status_str: String,
        /// The vendor's syndrome.
        vendor_err: u32,
    },
    /// A completion names no outstanding work request.
    #[error("completion for queue pair {qp_num}, work request {wr_id}, matches nothing posted")]
    UnknownCompletion {
        /// Its queue pair number.
        qp_num: u32,
        /// Its `wr_id`.
        wr_id: u64,
    },
}
