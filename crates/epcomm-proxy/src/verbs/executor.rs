//! [`VerbsExecutor`]: the proxy's operations as RDMA WRITEs on one RC queue pair per peer.
//!
//! Set-up, in two steps so the caller's bootstrap can sit between them:
//!
//! 1. [`PreparedVerbs::prepare`] loads libibverbs, selects the device, port and GID
//!    ([`super::select`]), allocates a protection domain, registers the symmetric buffer
//!    ([`HeapMemory`]: an address range, or a dma-buf), creates one completion queue and one
//!    queue pair per peer (itself included: its queue pair connects to itself) and moves them to
//!    INIT. [`PreparedVerbs::endpoint_bytes`] is this rank's [`RankEndpoints`] record.
//! 2. [`PreparedVerbs::connect`] takes every rank's record (an all-gather, `records[r]` from
//!    rank `r`), checks them, and moves each queue pair INIT → RTR → RTS towards its peer.
//!
//! [`VerbsExecutor::new`] does both around a caller's all-gather closure.
//!
//! Operations (see [`super::flow`] for the bookkeeping):
//!
//! * transfer: RDMA WRITE from the registered buffer ([`Source::Heap`]) or from any address
//!   inside a registered region ([`Source::Address`]: the symmetric buffer's range, one added
//!   by [`VerbsExecutor::register_source`], or one of its [`SourceRegistry`], which other
//!   threads fill while the executor runs on the proxy's; anything else is
//!   [`VerbsOpError::SourceNotRegistered`]); split into writes of at most the port's
//!   `max_msg_sz` (capped at 1 GiB);
//! * write: inline RDMA WRITE of the 4 or 8 bytes;
//! * signal: inline RDMA WRITE of 8 bytes: the value (SET) or the shadow word's running sum
//!   (ADD; see [`super::flow`] for why not a fetch-and-add).
//!
//! Ordering: one RC queue pair per peer executes its requests in order, and RDMA WRITEs on it
//! are placed at the responder in order on the NICs this targets (mlx5, rxe) when relaxed
//! ordering is off, which is how the regions are registered here; so a signal lands after the
//! writes before it. The InfiniBand specification itself only guarantees that a WRITE's
//! completion follows the placement of the earlier ones, not the order in which a remote CPU
//! or GPU observes the bytes: on a NIC that places out of order the signal would need
//! `IBV_SEND_FENCE` behind an RDMA READ, which is not done here.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::endpoint::{QpEndpoint, RankEndpoints};
use super::flow::{self, INLINE_MAX, Payload, SendQueue, ShadowWords, WrKind};
use super::qp_state::{self, PSN_MASK, PathParams};
use super::resources::{CompletionQueue, MemoryRegion, ProtectionDomain, QueuePair};
use super::select::{self, DeviceSelector, GidSelector, Selected};
use super::sources::{SourceRegion, SourceRegistry};
use super::sys::{IBV_WC_SUCCESS, IbvWc};
use super::{LibrarySearch, Verbs, VerbsError, VerbsOpError};
use crate::descriptor::{Signal, SignalOp, Source, Transfer, Write};
use crate::executor::{Executor, OpFailure, OpId, Submit};

/// The symmetric buffer to register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeapMemory {
    /// `[addr, addr + bytes)` in this process: host memory, or GPU memory where the
    /// peer-memory module (`nvidia-peermem`) is loaded.
    Address {
        /// Start.
        addr: u64,
        /// Length.
        bytes: u64,
    },
    /// `bytes` bytes at `offset` of a dma-buf (GPU memory without peer-memory:
    /// `cuMemGetHandleForAddressRange`), addressed at `iova` — pass the buffer's device
    /// address so [`Source::Address`] sources inside it resolve.
    DmaBuf {
        /// The dma-buf file descriptor (borrowed: the caller keeps it open while registered).
        fd: RawFd,
        /// Offset in the dma-buf.
        offset: u64,
        /// Length.
        bytes: u64,
        /// The address work requests use for its first byte.
        iova: u64,
    },
}

impl HeapMemory {
    /// Its length.
    pub fn bytes(&self) -> u64 {
        match *self {
            HeapMemory::Address { bytes, .. } | HeapMemory::DmaBuf { bytes, .. } => bytes,
        }
    }
}

/// Everything [`PreparedVerbs::prepare`] needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsConfig {
    /// This rank.
    pub rank: u32,
    /// Ranks (one queue pair to each, this rank's included).
    pub world: u32,
    /// The symmetric buffer.
    pub heap: HeapMemory,
    /// Where to find libibverbs.
    pub library: LibrarySearch,
    /// Which device.
    pub device: DeviceSelector,
    /// Which port (`None`: the first active one).
    pub port: Option<u8>,
    /// Which GID.
    pub gid: GidSelector,
    /// Send queue depth per peer (work requests in flight; a full queue is `Submit::Busy`).
    pub send_queue_depth: u32,
    /// At most this many unsignalled work requests in a row.
    pub signal_every: u32,
    /// Inline bytes asked for (≥ 8: writes and signals are inline).
    pub max_inline: u32,
    /// `enum ibv_mtu` of the paths (`None`: the port's active MTU).
    pub mtu: Option<u32>,
    /// Traffic class (RoCE: DSCP << 2).
    pub traffic_class: u8,
    /// Service level.
    pub service_level: u8,
    /// Local ACK timeout exponent (≤ 31).
    pub timeout: u8,
    /// Retries on timeout (≤ 7).
    pub retry_cnt: u8,
}

impl VerbsConfig {
    /// Rank `rank` of `world` over `heap`, with the defaults: libibverbs searched as
    /// [`LibrarySearch::from_env`], the first active device and port, the RoCE v2 GID, 256
    /// requests per send queue, signalled every 16, 64 inline bytes, the port's MTU, timeout
    /// 14, 7 retries.
    pub fn new(rank: u32, world: u32, heap: HeapMemory) -> VerbsConfig {
        VerbsConfig {
            rank,
            world,
            heap,
            library: LibrarySearch::from_env(),
            device: DeviceSelector::FirstActive,
            port: None,
            gid: GidSelector::RoceV2,
            send_queue_depth: 256,
            signal_every: 16,
            max_inline: 64,
            mtu: None,
            traffic_class: 0,
            service_level: 0,
            timeout: 14,
            retry_cnt: 7,
        }
    }

    /// Checks every rule; reads nothing.
    ///
    /// # Errors
    /// [`VerbsError::Config`] naming the first argument that breaks its rule.
    pub fn validate(&self) -> Result<(), VerbsError> {
        let bad = |argument, value: String, rule| {
            Err(VerbsError::Config {
                argument,
                value,
                rule,
            })
        };
        if self.world == 0 {
            return bad("world", "0".into(), "must be at least 1");
        }
        if self.rank >= self.world {
            return bad("rank", self.rank.to_string(), "must be less than world");
        }
        if self.heap.bytes() == 0 {
            return bad("heap", "0 bytes".into(), "must not be empty");
        }
        if let HeapMemory::Address { addr, bytes } = self.heap
            && (addr == 0 || addr.checked_add(bytes).is_none())
        {
            return bad(
                "heap",
                format!("{addr:#x} + {bytes}"),
                "must be a non-null range that does not wrap",
            );
        }
        if self.send_queue_depth == 0 {
            return bad("send_queue_depth", "0".into(), "must be at least 1");
        }
        if self.signal_every == 0 {
            return bad("signal_every", "0".into(), "must be at least 1");
        }
        if self.max_inline < 8 {
            return bad(
                "max_inline",
                self.max_inline.to_string(),
                "must be at least 8 (writes and signals are inline)",
            );
        }
        if let Some(mtu) = self.mtu
            && !(1..=5).contains(&mtu)
        {
            return bad(
                "mtu",
                mtu.to_string(),
                "must be an enum ibv_mtu value, 1..=5",
            );
        }
        if self.timeout > 31 {
            return bad("timeout", self.timeout.to_string(), "must be at most 31");
        }
        if self.retry_cnt > 7 {
            return bad("retry_cnt", self.retry_cnt.to_string(), "must be at most 7");
        }
        let cqe = u64::from(self.world) * u64::from(self.send_queue_depth);
        if cqe > i32::MAX as u64 {
            return bad(
                "send_queue_depth",
                self.send_queue_depth.to_string(),
                "world x send_queue_depth (completion queue entries) must fit in a C int",
            );
        }
        Ok(())
    }
}

/// Largest RDMA WRITE issued.
pub const MAX_CHUNK_BYTES: u64 = 1 << 30;

/// Queue pairs created and in INIT, waiting for the peers' endpoints (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct PreparedVerbs {
    config: VerbsConfig,
    qps: Vec<QueuePair>,
    psns: Vec<u32>,
    heap: MemoryRegion,
    cq: Arc<CompletionQueue>,
    pd: Arc<ProtectionDomain>,
    selected: Selected,
    params: PathParams,
    local: RankEndpoints,
    verbs: Arc<Verbs>,
}

/// An initial PSN for the queue pair `qpn`: 24 bits that differ between runs.
fn initial_psn(qpn: u32, rank: u32) -> u32 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (nanos ^ qpn.wrapping_mul(0x9e37_79b9) ^ rank.wrapping_mul(0x85eb_ca6b)) & PSN_MASK
}

impl PreparedVerbs {
    /// Step 1 (see the [module docs](self)).
    ///
    /// # Safety
    /// The symmetric buffer (`config.heap`) must stay valid (mapped; the dma-buf open) until
    /// the executor is dropped, and may be written by peers at any time meanwhile.
    ///
    /// # Errors
    /// [`VerbsError::Config`] first (nothing is loaded for an invalid configuration); then
    /// [`VerbsError::Load`], [`VerbsError::NoDevice`] on a machine without an RDMA device, and
    /// the other selection, registration and creation errors.
    pub unsafe fn prepare(config: VerbsConfig) -> Result<PreparedVerbs, VerbsError> {
        config.validate()?;
        let verbs = Arc::new(Verbs::load(&config.library)?);
        let selected = select::select(&verbs, &config.device, config.port, config.gid)?;
        let pd = Arc::new(ProtectionDomain::new(&selected.context)?);
        let heap = match config.heap {
            // SAFETY: the caller guarantees the range (this function's contract).
            HeapMemory::Address { addr, bytes } => unsafe {
                MemoryRegion::register(&pd, addr, bytes)?
            },
            HeapMemory::DmaBuf {
                fd,
                offset,
                bytes,
                iova,
            } => {
                // SAFETY: the caller guarantees the dma-buf (this function's contract).
                unsafe { MemoryRegion::register_dmabuf(&pd, fd, offset, bytes, iova)? }
            }
        };
        let depth = config.send_queue_depth;
        let cq = Arc::new(CompletionQueue::new(
            &selected.context,
            config.world as usize * depth as usize,
        )?);
        let mtu = config.mtu.unwrap_or(selected.port_attr.active_mtu);
        let mut params = PathParams::new(selected.port, mtu, selected.gid_index, selected.global);
        params.traffic_class = config.traffic_class;
        params.service_level = config.service_level;
        params.timeout = config.timeout;
        params.retry_cnt = config.retry_cnt;
        let mut qps = Vec::with_capacity(config.world as usize);
        let mut psns = Vec::with_capacity(config.world as usize);
        for peer in 0..config.world {
            let mut qp = QueuePair::new(&pd, &cq, depth, config.max_inline)?;
            if qp.cap().max_inline_data < 8 {
                return Err(VerbsError::Config {
                    argument: "max_inline",
                    value: qp.cap().max_inline_data.to_string(),
                    rule: "the device granted fewer than 8 inline bytes: writes and signals \
                           are inline",
                });
            }
            let t = qp_state::to_init(&params);
            qp.modify(&t).map_err(|source| VerbsError::ModifyQp {
                peer,
                from: t.from,
                to: t.to,
                mask: t.mask,
                source,
            })?;
            psns.push(initial_psn(qp.qpn(), config.rank));
            qps.push(qp);
        }
        let local = RankEndpoints {
            rank: config.rank,
            world: config.world,
            heap_bytes: config.heap.bytes(),
            endpoints: qps
                .iter()
                .zip(&psns)
                .map(|(qp, &psn)| QpEndpoint {
                    qpn: qp.qpn(),
                    psn,
                    gid: selected.gid,
                    lid: selected.port_attr.lid,
                    rkey: heap.rkey(),
                    base_addr: heap.base(),
                })
                .collect(),
        };
        Ok(PreparedVerbs {
            config,
            qps,
            psns,
            heap,
            cq,
            pd,
            selected,
            params,
            local,
            verbs,
        })
    }

    /// This rank's endpoints.
    pub fn endpoints(&self) -> &RankEndpoints {
        &self.local
    }

    /// This rank's record for the all-gather.
    pub fn endpoint_bytes(&self) -> Vec<u8> {
        self.local.to_bytes()
    }

    /// The device chosen.
    pub fn device(&self) -> &str {
        self.selected.context.name()
    }

    /// Step 2: connects every queue pair (`records[r]` is rank `r`'s record).
    ///
    /// # Errors
    /// [`VerbsError::Endpoint`] for a bad record; [`VerbsError::ModifyQp`] naming the peer and
    /// transition.
    pub fn connect(self, records: &[Vec<u8>]) -> Result<VerbsExecutor, VerbsError> {
        let PreparedVerbs {
            config,
            mut qps,
            psns,
            heap,
            cq,
            pd,
            selected,
            params,
            local: _,
            verbs,
        } = self;
        let all = RankEndpoints::parse_all(config.world, config.heap.bytes(), records)?;
        let depth = config.send_queue_depth as usize;
        let mut peers = Vec::with_capacity(qps.len());
        let mut qpn_to_peer = HashMap::new();
        // Every queue pair was checked to grant at least 8 inline bytes when it was made.
        let granted = qps
            .iter()
            .map(|qp| qp.cap().max_inline_data as usize)
            .min()
            .unwrap_or(8);
        let inline = granted.clamp(8, INLINE_MAX) / 8 * 8;
        for (peer, (mut qp, psn)) in qps.drain(..).zip(psns).enumerate() {
            let peer = peer as u32;
            let remote = all[peer as usize].endpoints[config.rank as usize];
            for t in [
                qp_state::to_rtr(&params, &remote),
                qp_state::to_rts(&params, psn),
            ] {
                qp.modify(&t).map_err(|source| VerbsError::ModifyQp {
                    peer,
                    from: t.from,
                    to: t.to,
                    mask: t.mask,
                    source,
                })?;
            }
            qpn_to_peer.insert(qp.qpn(), peer);
            peers.push(PeerQp {
                qp,
                queue: SendQueue::new(depth, config.signal_every as usize),
                remote_base: remote.base_addr,
                rkey: remote.rkey,
            });
        }
        let max_msg = u64::from(selected.port_attr.max_msg_sz);
        let chunk = if max_msg == 0 {
            MAX_CHUNK_BYTES
        } else {
            max_msg.min(MAX_CHUNK_BYTES)
        };
        Ok(VerbsExecutor {
            peers,
            sources: Vec::new(),
            registry: SourceRegistry::new(Arc::clone(&pd)),
            snapshot: Vec::new(),
            snapshot_generation: 0,
            heap,
            cq,
            _pd: pd,
            qpn_to_peer,
            rank: config.rank,
            world: config.world,
            heap_bytes: config.heap.bytes(),
            chunk,
            inline,
            shadow: ShadowWords::default(),
            wcs: vec![IbvWc::default(); 64],
            device: selected.context.name().to_string(),
            verbs,
        })
    }
}

/// One peer's queue pair and its bookkeeping.
#[derive(Debug)]
struct PeerQp {
    qp: QueuePair,
    queue: SendQueue,
    remote_base: u64,
    rkey: u32,
}

/// The verbs executor (see the [module docs](self)).
#[derive(Debug)]
pub struct VerbsExecutor {
    // Declared first, dropped first: queue pairs before the regions they use.
    peers: Vec<PeerQp>,
    sources: Vec<MemoryRegion>,
    /// Regions other threads register ([`VerbsExecutor::source_registry`]), and this thread's
    /// snapshot of them as of `snapshot_generation`.
    registry: SourceRegistry,
    snapshot: Vec<Arc<SourceRegion>>,
    snapshot_generation: u64,
    heap: MemoryRegion,
    cq: Arc<CompletionQueue>,
    _pd: Arc<ProtectionDomain>,
    qpn_to_peer: HashMap<u32, u32>,
    rank: u32,
    world: u32,
    heap_bytes: u64,
    chunk: u64,
    /// Bytes per inline work request: the queue pairs' `max_inline_data` (at least 8), at most
    /// [`INLINE_MAX`], a multiple of 8.
    inline: usize,
    shadow: ShadowWords,
    wcs: Vec<IbvWc>,
    device: String,
    verbs: Arc<Verbs>,
}

impl VerbsExecutor {
    /// [`PreparedVerbs::prepare`], `all_gather` of this rank's record (it returns every
    /// rank's record, `[r]` from rank `r`), then [`PreparedVerbs::connect`].
    ///
    /// # Safety
    /// As [`PreparedVerbs::prepare`].
    ///
    /// # Errors
    /// Those of both steps; [`VerbsError::Bootstrap`] when `all_gather` fails.
    pub unsafe fn new<E>(
        config: VerbsConfig,
        all_gather: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>, E>,
    ) -> Result<VerbsExecutor, VerbsError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        // SAFETY: forwarded from this function's contract.
        let prepared = unsafe { PreparedVerbs::prepare(config)? };
        let records = all_gather(&prepared.endpoint_bytes())
            .map_err(|e| VerbsError::Bootstrap { source: e.into() })?;
        prepared.connect(&records)
    }

    /// Registers `[addr, addr + bytes)` as a source of [`Source::Address`] transfers.
    ///
    /// # Safety
    /// As [`MemoryRegion::register`]: the range stays mapped while the executor lives.
    ///
    /// # Errors
    /// [`VerbsError::Call`] for `ibv_reg_mr`.
    pub unsafe fn register_source(&mut self, addr: u64, bytes: u64) -> Result<(), VerbsError> {
        // SAFETY: forwarded from this function's contract.
        let mr = unsafe { MemoryRegion::register(&self._pd, addr, bytes)? };
        self.sources.push(mr);
        Ok(())
    }

    /// The registry of source regions this executor reads [`Source::Address`] transfers from,
    /// besides the symmetric buffer and [`VerbsExecutor::register_source`]'s: a handle other
    /// threads keep to register memory after the executor has moved to the proxy's thread.
    pub fn source_registry(&self) -> SourceRegistry {
        self.registry.clone()
    }

    /// Takes a new snapshot of the registry when it changed since the last one.
    fn refresh_sources(&mut self) {
        if self.registry.generation() != self.snapshot_generation {
            (self.snapshot_generation, self.snapshot) = self.registry.snapshot();
        }
    }

    /// The device in use.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    fn peer(&mut self, peer: u32) -> Result<&mut PeerQp, VerbsOpError> {
        let world = self.world;
        self.peers
            .get_mut(peer as usize)
            .ok_or(VerbsOpError::PeerOutOfRange { peer, world })
    }

    fn check_range(
        &self,
        what: &'static str,
        peer: u32,
        offset: u64,
        bytes: u64,
    ) -> Result<(), VerbsOpError> {
        match offset.checked_add(bytes) {
            Some(end) if end <= self.heap_bytes => Ok(()),
            _ => Err(VerbsOpError::OutOfBounds {
                what,
                peer,
                offset,
                bytes,
                heap_bytes: self.heap_bytes,
            }),
        }
    }

    /// The local address and key of a transfer's source.
    fn source(&self, peer: u32, src: Source, bytes: u64) -> Result<(u64, u32), VerbsOpError> {
        match src {
            Source::Heap(offset) => {
                self.check_range("transfer source", peer, offset, bytes)?;
                Ok((self.heap.base() + offset, self.heap.lkey()))
            }
            Source::Address(address) => self
                .regions()
                .find(|mr| mr.contains(address, bytes))
                .map(|mr| (address, mr.lkey()))
                .ok_or_else(|| VerbsOpError::SourceNotRegistered {
                    peer,
                    address,
                    bytes,
                    regions: self
                        .regions()
                        .map(|mr| format!("[{:#x}, {:#x})", mr.base(), mr.base() + mr.bytes()))
                        .collect::<Vec<_>>()
                        .join(", "),
                }),
        }
    }

    /// Every region an address source may lie in: the symmetric buffer, then
    /// [`VerbsExecutor::register_source`]'s, then the registry's (as of the last refresh).
    fn regions(&self) -> impl Iterator<Item = &MemoryRegion> {
        std::iter::once(&self.heap)
            .chain(&self.sources)
            .chain(self.snapshot.iter().map(|r| r.region()))
    }

    fn transfer(&mut self, op: OpId, t: &Transfer) -> Result<Submit, VerbsOpError> {
        self.check_range("transfer destination", t.peer, t.dst_offset, t.bytes)?;
        if matches!(t.src, Source::Address(_)) {
            self.refresh_sources();
        }
        let (local, lkey) = self.source(t.peer, t.src, t.bytes)?;
        let chunk = self.chunk;
        let needed = t.bytes.div_ceil(chunk);
        let p = self.peer(t.peer)?;
        if needed > p.queue.depth() as u64 {
            return Err(VerbsOpError::TooLarge {
                peer: t.peer,
                bytes: t.bytes,
                needed,
                chunk,
                depth: p.queue.depth(),
            });
        }
        if !p.queue.has_room(needed as usize) {
            return Ok(Submit::Busy);
        }
        let remote = p.remote_base + t.dst_offset;
        let last = needed.saturating_sub(1);
        for (i, (start, len)) in flow::chunks(t.bytes, chunk).enumerate() {
            let payload = Payload::Gather {
                addr: local + start,
                len: len as u32,
                lkey,
            };
            let this_op = (i as u64 == last).then_some(op);
            p.queue
                .push(
                    remote + start,
                    p.rkey,
                    payload,
                    this_op,
                    WrKind::Transfer,
                    &mut p.qp,
                )
                .map_err(|(_, message)| VerbsOpError::PostSend {
                    peer: t.peer,
                    message,
                })?;
        }
        Ok(Submit::Accepted)
    }

    /// Posts `bytes` (little-endian elements of `width` bytes, to consecutive places from
    /// `offset` on) as inline RDMA WRITEs of at most `inline` bytes each (whole elements), all
    /// or none: `Busy` when the send queue has no room for all of them. Only the last names
    /// `op`: its completion is the operation's (an RC queue pair completes its work requests
    /// in order).
    fn inline(
        &mut self,
        op: OpId,
        peer: u32,
        offset: u64,
        bytes: &[u8],
        width: usize,
        kind: WrKind,
    ) -> Result<Submit, VerbsOpError> {
        let per_wr = self.inline / width * width;
        let p = self.peer(peer)?;
        let n = bytes.len().div_ceil(per_wr);
        if n > p.queue.depth() {
            return Err(VerbsOpError::TooLarge {
                peer,
                bytes: bytes.len() as u64,
                needed: n as u64,
                chunk: per_wr as u64,
                depth: p.queue.depth(),
            });
        }
        if !p.queue.has_room(n) {
            return Ok(Submit::Busy);
        }
        for (j, part) in bytes.chunks(per_wr).enumerate() {
            let mut inline = [0u8; INLINE_MAX];
            inline[..part.len()].copy_from_slice(part);
            let payload = Payload::Inline {
                bytes: inline,
                len: part.len() as u8,
            };
            p.queue
                .push(
                    p.remote_base + offset + (j * per_wr) as u64,
                    p.rkey,
                    payload,
                    (j + 1 == n).then_some(op),
                    kind,
                    &mut p.qp,
                )
                .map_err(|(_, message)| VerbsOpError::PostSend { peer, message })?;
        }
        Ok(Submit::Accepted)
    }

    fn write(&mut self, op: OpId, w: &Write) -> Result<Submit, VerbsOpError> {
        let len = w.width.bytes();
        self.check_range("write", w.peer, w.offset, w.bytes())?;
        let bytes: Vec<u8> = w.le_bytes().collect();
        let submitted = self.inline(op, w.peer, w.offset, &bytes, len as usize, WrKind::Write)?;
        if submitted == Submit::Accepted && len == 8 {
            for j in 0..w.count {
                let at = w.offset + 8 * u64::from(j);
                if self.shadow.tracks(w.peer, at) {
                    self.shadow.commit(w.peer, at, w.element(j));
                }
            }
        }
        Ok(submitted)
    }

    fn signal(&mut self, op: OpId, s: &Signal) -> Result<Submit, VerbsOpError> {
        self.check_range("signal", s.peer, s.offset, s.bytes())?;
        let add = s.op == SignalOp::Add;
        // An add has one word (the decoder refuses more); a set stores the value in each.
        let values: Vec<u64> = (0..u64::from(s.words))
            .map(|k| self.shadow.next(s.peer, s.offset + 8 * k, s.value, add))
            .collect();
        let kind = if add {
            WrKind::SignalAdd
        } else {
            WrKind::SignalSet
        };
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let submitted = self.inline(op, s.peer, s.offset, &bytes, 8, kind)?;
        if submitted == Submit::Accepted {
            for (k, &v) in values.iter().enumerate() {
                self.shadow.commit(s.peer, s.offset + 8 * k as u64, v);
            }
        }
        Ok(submitted)
    }

    /// The oldest operation still outstanding, to name a failure that matches none.
    fn any_outstanding(&self, fallback: OpId) -> OpId {
        self.peers
            .iter()
            .filter_map(|p| p.queue.oldest_op())
            .min()
            .unwrap_or(fallback)
    }

    fn poll_inner(&mut self, done: &mut Vec<OpId>) -> Result<(), (Option<OpId>, VerbsOpError)> {
        for (peer, p) in self.peers.iter_mut().enumerate() {
            p.queue.flush(&mut p.qp).map_err(|(op, message)| {
                (
                    op,
                    VerbsOpError::PostSend {
                        peer: peer as u32,
                        message,
                    },
                )
            })?;
        }
        // Bounded: each round either empties the queue or takes a full batch, and the queue
        // never holds more than the send queues' total depth.
        let rounds = self.peers.len() * self.peers.first().map_or(1, |p| p.queue.depth()) + 1;
        for _ in 0..rounds {
            let n = self
                .cq
                .poll(&mut self.wcs)
                .map_err(|code| (None, VerbsOpError::PollCq { code }))?;
            for i in 0..n {
                let wc = self.wcs[i];
                let Some(&peer) = self.qpn_to_peer.get(&wc.qp_num) else {
                    return Err((
                        None,
                        VerbsOpError::UnknownCompletion {
                            qp_num: wc.qp_num,
                            wr_id: wc.wr_id,
                        },
                    ));
                };
                let p = &mut self.peers[peer as usize];
                if wc.status != IBV_WC_SUCCESS {
                    let failed = p.queue.failed(wc.wr_id);
                    return Err((
                        failed.op,
                        VerbsOpError::Completion {
                            peer,
                            opcode: failed.kind.map_or("work request", WrKind::opcode),
                            status: wc.status,
                            status_str: super::resources::wc_status_str(&self.verbs, wc.status),
                            vendor_err: wc.vendor_err,
                        },
                    ));
                }
                if p.queue.complete(wc.wr_id, done).is_err() {
                    return Err((
                        None,
                        VerbsOpError::UnknownCompletion {
                            qp_num: wc.qp_num,
                            wr_id: wc.wr_id,
                        },
                    ));
                }
            }
            if n < self.wcs.len() {
                break;
            }
        }
        Ok(())
    }
}

impl Executor for VerbsExecutor {
    fn name(&self) -> &str {
        "verbs"
    }

    fn submit_transfer(&mut self, op: OpId, transfer: &Transfer) -> Result<Submit, OpFailure> {
        self.transfer(op, transfer)
            .map_err(|e| OpFailure::new(op, e))
    }

    fn submit_signal(&mut self, op: OpId, signal: &Signal) -> Result<Submit, OpFailure> {
        self.signal(op, signal).map_err(|e| OpFailure::new(op, e))
    }

    fn submit_write(&mut self, op: OpId, write: &Write) -> Result<Submit, OpFailure> {
        self.write(op, write).map_err(|e| OpFailure::new(op, e))
    }

    fn poll(&mut self, done: &mut Vec<OpId>) -> Result<(), OpFailure> {
        let first_done = done.len();
        self.poll_inner(done).map_err(|(op, e)| {
            let fallback = done.get(first_done).copied().unwrap_or(0);
            OpFailure::new(op.unwrap_or_else(|| self.any_outstanding(fallback)), e)
        })
    }
}
