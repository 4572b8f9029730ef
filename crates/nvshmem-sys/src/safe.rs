//! Safe layer: an initialised runtime, RAII symmetric memory, scoped module registration.
//!
//! NVSHMEM is process-global: at most one [`Nvshmem`] exists per process at a time. Many calls
//! are *collective* (every PE must make them, in the same order): [`Nvshmem::init_with_uniqueid`],
//! [`SymmetricAlloc`] creation and drop, [`Nvshmem::barrier_all`], and dropping [`Nvshmem`]
//! (finalize). Calling them on only some PEs hangs the others; that is a protocol contract
//! Rust cannot check.
//!
//! The runtime is initialised with NVSHMEM's serialised thread level, so [`Nvshmem`] may move
//! between threads (`Send`) but is not shared between them (`!Sync`).

use std::cell::Cell;
use std::marker::PhantomData;
use std::os::raw::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::attr::{self, UniqueIdError};
use crate::loader::Library;
use crate::result::{self, NvshmemError};
use crate::sys;

/// Errors of the safe layer; each names the argument or call and the rule broken.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An NVSHMEM call returned a non-zero status.
    #[error(transparent)]
    Nvshmem(#[from] NvshmemError),
    /// The unique-id bytes received are malformed.
    #[error("uid_bytes: {0}")]
    UniqueId(#[from] UniqueIdError),
    /// `world` is zero or does not fit a C `int`.
    #[error("world must be between 1 and {max}, got {world}")]
    InvalidWorld {
        /// The value passed.
        world: usize,
        /// `c_int::MAX`.
        max: c_int,
    },
    /// `rank >= world`.
    #[error("rank must be below world ({world}), got {rank}")]
    InvalidRank {
        /// The value passed.
        rank: usize,
        /// The world size passed.
        world: usize,
    },
    /// NVSHMEM is already initialised in this process (by another [`Nvshmem`] or other code).
    #[error("NVSHMEM is already initialised in this process (nvshmemx_init_status = {status})")]
    AlreadyInitialized {
        /// What `nvshmemx_init_status` reported (0 when another `Nvshmem` is being created).
        status: c_int,
    },
    /// After initialisation NVSHMEM reports another PE/size than requested.
    #[error("NVSHMEM initialised as PE {pe} of {n_pes}, but rank {rank} of {world} was requested")]
    RankMismatch {
        /// The rank requested.
        rank: usize,
        /// The world size requested.
        world: usize,
        /// `nvshmem_my_pe()`.
        pe: c_int,
        /// `nvshmem_n_pes()`.
        n_pes: c_int,
    },
    /// A symmetric allocation of zero bytes was requested.
    #[error("bytes must be non-zero for a symmetric allocation")]
    ZeroSizeAlloc,
    /// `alignment` is not a power of two.
    #[error("alignment must be a power of two, got {alignment}")]
    InvalidAlignment {
        /// The value passed.
        alignment: usize,
    },
    /// NVSHMEM returned NULL: the symmetric heap (`NVSHMEM_SYMMETRIC_SIZE`) is exhausted.
    #[error(
        "{call}({bytes} bytes) returned NULL: symmetric heap exhausted (raise NVSHMEM_SYMMETRIC_SIZE)"
    )]
    OutOfSymmetricMemory {
        /// The allocation function.
        call: &'static str,
        /// The size requested.
        bytes: usize,
    },
    /// A null `CUmodule` was passed.
    #[error("module must be a non-null CUmodule")]
    NullModule,
    /// A buffer registration of address 0 or of zero bytes was requested.
    #[error(
        "a buffer registration needs a non-null address and a non-zero length, got {bytes} bytes at {addr:#x}"
    )]
    EmptyRegistration {
        /// The address passed.
        addr: u64,
        /// The length passed.
        bytes: usize,
    },
    /// A buffer registration of memory inside the symmetric heap was requested: NVSHMEM
    /// registers the heap itself and refuses it.
    #[error(
        "[{addr:#x}, +{bytes}) lies in the NVSHMEM symmetric heap, which is registered already \
         and must not be registered as a local buffer"
    )]
    SymmetricRegistration {
        /// The address passed.
        addr: u64,
        /// The length passed.
        bytes: usize,
    },
}

/// Set while an [`Nvshmem`] exists in this process.
static RUNTIME_LIVE: AtomicBool = AtomicBool::new(false);

/// A team handle usable from the safe layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Team {
    /// `NVSHMEM_TEAM_WORLD`: every PE.
    World,
    /// `NVSHMEM_TEAM_SHARED`: the PEs whose memory this PE can load/store directly.
    Shared,
    /// `NVSHMEMX_TEAM_NODE`: the PEs on this node.
    Node,
}

impl Team {
    /// The C team handle.
    pub fn raw(self) -> sys::nvshmem_team_t {
        match self {
            Team::World => sys::NVSHMEM_TEAM_WORLD,
            Team::Shared => sys::NVSHMEM_TEAM_SHARED,
            Team::Node => sys::NVSHMEMX_TEAM_NODE,
        }
    }
}

/// The initialised NVSHMEM runtime of this process; `nvshmemx_hostlib_finalize` on drop
/// (collective).
pub struct Nvshmem {
    lib: Arc<Library>,
    pe: u32,
    n_pes: u32,
    _not_sync: PhantomData<Cell<()>>,
}

impl std::fmt::Debug for Nvshmem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvshmem")
            .field("lib", &self.lib)
            .field("pe", &self.pe)
            .field("n_pes", &self.n_pes)
            .finish()
    }
}

impl Nvshmem {
    /// A fresh unique id, as the bytes to ship to every other rank (rank 0 calls this before
    /// anyone initialises). Needs no GPU.
    ///
    /// # Errors
    /// [`Error::Nvshmem`] when `nvshmemx_get_uniqueid` fails.
    pub fn get_uniqueid(lib: &Library) -> Result<Vec<u8>, Error> {
        // SAFETY: `lib` is a loaded, version-checked NVSHMEM 3.4 host library.
        let id = unsafe { result::get_uniqueid(lib.api()) }?;
        Ok(attr::uniqueid_to_bytes(&id))
    }

    /// Initialises NVSHMEM as PE `rank` of `world`, bootstrapped by the unique id from rank 0
    /// (`uid_bytes`, as [`Nvshmem::get_uniqueid`] returned it). Collective: blocks until all
    /// `world` ranks have called it.
    ///
    /// The CUDA context of the GPU this PE uses must be current on the calling thread (NVSHMEM
    /// binds to it); that is not checked here (the crate does not depend on a CUDA binding).
    ///
    /// # Errors
    /// [`Error::InvalidWorld`], [`Error::InvalidRank`], [`Error::UniqueId`] for bad arguments
    /// (checked before any call); [`Error::AlreadyInitialized`]; [`Error::Nvshmem`] when
    /// initialisation fails; [`Error::RankMismatch`] when NVSHMEM disagrees about rank/world.
    pub fn init_with_uniqueid(
        lib: Arc<Library>,
        rank: usize,
        world: usize,
        uid_bytes: &[u8],
    ) -> Result<Nvshmem, Error> {
        let world_c =
            c_int::try_from(world)
                .ok()
                .filter(|&w| w >= 1)
                .ok_or(Error::InvalidWorld {
                    world,
                    max: c_int::MAX,
                })?;
        if rank >= world {
            return Err(Error::InvalidRank { rank, world });
        }
        let rank_c = rank as c_int; // < world_c, so it fits.
        let id = attr::uniqueid_from_bytes(uid_bytes)?;
        if RUNTIME_LIVE.swap(true, Ordering::AcqRel) {
            return Err(Error::AlreadyInitialized { status: 0 });
        }
        let release = |e: Error| {
            RUNTIME_LIVE.store(false, Ordering::Release);
            e
        };
        let status = result::init_status(lib.api());
        if status != sys::NVSHMEM_STATUS_NOT_INITIALIZED as c_int {
            return Err(release(Error::AlreadyInitialized { status }));
        }
        // SAFETY: arguments validated above; no runtime is initialised (status checked and the
        // process-wide flag taken); the context requirement is the documented caller contract
        // (NVSHMEM reports a missing context as an error status, it does not crash).
        unsafe { result::init_attr_with_uniqueid(lib.api(), rank_c, world_c, &id) }
            .map_err(|e| release(e.into()))?;
        // SAFETY: initialisation succeeded just above.
        let (pe, n_pes) = unsafe { (result::my_pe(lib.api()), result::n_pes(lib.api())) };
        let rt = Nvshmem {
            lib,
            pe: pe.max(0) as u32,
            n_pes: n_pes.max(0) as u32,
            _not_sync: PhantomData,
        };
        if pe != rank_c || n_pes != world_c {
            // Dropping `rt` finalises, keeping the process in a clean state.
            drop(rt);
            return Err(Error::RankMismatch {
                rank,
                world,
                pe,
                n_pes,
            });
        }
        Ok(rt)
    }

    /// The loaded library.
    pub fn library(&self) -> &Arc<Library> {
        &self.lib
    }

    /// `nvshmem_my_pe()`, cached at initialisation.
    pub fn my_pe(&self) -> u32 {
        self.pe
    }

    /// `nvshmem_n_pes()`, cached at initialisation.
    pub fn n_pes(&self) -> u32 {
        self.n_pes
    }

    /// This PE's index in `team`, `None` when it is not a member.
    pub fn team_my_pe(&self, team: Team) -> Option<u32> {
        // SAFETY: initialised; `team.raw()` is one of the predefined team handles.
        let pe = unsafe { result::team_my_pe(self.lib.api(), team.raw()) };
        u32::try_from(pe).ok()
    }

    /// The number of PEs in `team`, `None` when NVSHMEM reports it invalid.
    pub fn team_n_pes(&self, team: Team) -> Option<u32> {
        // SAFETY: initialised; `team.raw()` is one of the predefined team handles.
        let n = unsafe { result::team_n_pes(self.lib.api(), team.raw()) };
        u32::try_from(n).ok()
    }

    /// `nvshmem_barrier_all()`. Collective.
    pub fn barrier_all(&self) {
        // SAFETY: initialised; collectiveness is the documented protocol contract (a missing
        // PE hangs, it is not memory-unsafe).
        unsafe { result::barrier_all(self.lib.api()) }
    }

    /// `nvshmemx_barrier_all_on_stream(stream)`. Collective.
    ///
    /// # Safety
    /// `stream` is a live `CUstream` of the current context (or null: the legacy default
    /// stream).
    pub unsafe fn barrier_all_on_stream(&self, stream: *mut c_void) {
        // SAFETY: initialised; the stream contract is the caller's.
        unsafe { result::barrier_all_on_stream(self.lib.api(), stream) }
    }

    /// `nvshmem_quiet()`: waits for this PE's outstanding puts and atomics.
    pub fn quiet(&self) {
        // SAFETY: initialised.
        unsafe { result::quiet(self.lib.api()) }
    }

    /// `nvshmemx_quiet_on_stream(stream)`.
    ///
    /// # Safety
    /// As [`Nvshmem::barrier_all_on_stream`].
    pub unsafe fn quiet_on_stream(&self, stream: *mut c_void) {
        // SAFETY: initialised; the stream contract is the caller's.
        unsafe { result::quiet_on_stream(self.lib.api(), stream) }
    }
}

impl Drop for Nvshmem {
    fn drop(&mut self) {
        // SAFETY: initialised by `init_with_uniqueid`; every `SymmetricAlloc` and
        // `ModuleRegistration` borrows `self`, so none outlives this call.
        unsafe { result::hostlib_finalize(self.lib.api()) };
        RUNTIME_LIVE.store(false, Ordering::Release);
    }
}

impl Nvshmem {
    /// Whether `addr` lies in this PE's symmetric heap (`nvshmem_ptr(addr, my_pe)` is not
    /// NULL). Any address may be asked about: the host library only compares it with the
    /// heap's bounds.
    pub fn in_symmetric_heap(&self, addr: u64) -> bool {
        // SAFETY: initialised; `my_pe < n_pes` fits a c_int; `nvshmem_ptr` dereferences
        // nothing (see `result::ptr`).
        let p = unsafe { result::ptr(self.lib.api(), addr as *const c_void, self.pe as c_int) };
        p.is_some()
    }

    /// `nvshmem_ptr(ptr, pe)` for a live symmetric allocation `ptr` of this runtime; `None`
    /// when `pe` is not directly reachable or `pe >= n_pes`.
    fn peer_address(&self, ptr: NonNull<c_void>, pe: u32) -> Option<u64> {
        if pe >= self.n_pes {
            return None;
        }
        // SAFETY: initialised; `ptr` is a live symmetric allocation (callers own it); `pe <
        // n_pes` and so fits a c_int.
        let p = unsafe { result::ptr(self.lib.api(), ptr.as_ptr(), pe as c_int) };
        p.map(|p| p.as_ptr() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn teams_map_to_the_header_handles() {
        assert_eq!(Team::World.raw(), 0);
        assert_eq!(Team::Shared.raw(), 1);
        assert_eq!(Team::Node.raw(), 2);
    }

    #[test]
    fn errors_name_the_argument_and_rule() {
        let e = Error::InvalidRank { rank: 4, world: 4 };
        assert_eq!(e.to_string(), "rank must be below world (4), got 4");
        let e = Error::InvalidWorld {
            world: 0,
            max: c_int::MAX,
        };
        assert!(e.to_string().starts_with("world must be between 1 and"));
        let e = Error::UniqueId(UniqueIdError::Length {
            expected: 128,
            found: 3,
        });
        assert!(e.to_string().starts_with("uid_bytes: "));
    }

    #[test]
    fn registration_errors_name_the_range_and_rule() {
        let e = Error::EmptyRegistration {
            addr: 0x7f00_0000_0000,
            bytes: 0,
        };
        assert_eq!(
            e.to_string(),
            "a buffer registration needs a non-null address and a non-zero length, got 0 bytes \
             at 0x7f0000000000"
        );
        let e = Error::SymmetricRegistration {
            addr: 0x1000,
            bytes: 64,
        };
        let msg = e.to_string();
        assert!(
            msg.starts_with("[0x1000, +64) lies in the NVSHMEM symmetric heap"),
            "{msg}"
        );
        let e = Error::from(NvshmemError {
            call: "nvshmemx_buffer_register",
            code: 1,
        });
        assert_eq!(
            e.to_string(),
            "nvshmemx_buffer_register failed with status 1 (NVSHMEMX_ERROR_INVALID_VALUE)"
        );
    }

    fn assert_send<T: Send>() {}

    fn assert_sync<T: Sync>() {}

    #[test]
    fn runtime_is_send() {
        assert_send::<Nvshmem>();
    }

    #[test]
    fn registrations_move_between_threads() {
        assert_send::<BufferRegistration>();
        assert_sync::<BufferRegistration>();
    }
}

/// The runtime shared between threads and owners: [`Nvshmem`] behind a mutex (NVSHMEM's host
/// calls are serialised through it), so allocations can own a handle to it.
#[derive(Clone, Debug)]
pub struct SharedNvshmem {
    rt: Arc<std::sync::Mutex<Nvshmem>>,
    pe: u32,
    n_pes: u32,
}

impl SharedNvshmem {
    /// Wraps an initialised runtime.
    pub fn new(rt: Nvshmem) -> Self {
        let (pe, n_pes) = (rt.my_pe(), rt.n_pes());
        Self {
            rt: Arc::new(std::sync::Mutex::new(rt)),
            pe,
            n_pes,
        }
    }

    /// This PE.
    pub fn my_pe(&self) -> u32 {
        self.pe
    }

    /// Number of PEs.
    pub fn n_pes(&self) -> u32 {
        self.n_pes
    }

    /// Runs `f` with the runtime locked (a poisoned lock is still usable: the runtime holds no
    /// Rust invariants a panic could break).
    pub fn with<R>(&self, f: impl FnOnce(&Nvshmem) -> R) -> R {
        let guard = self.rt.lock().unwrap_or_else(|p| p.into_inner());
        f(&guard)
    }

    /// `nvshmem_barrier_all`. Collective.
    pub fn barrier_all(&self) {
        self.with(Nvshmem::barrier_all)
    }

    /// Whether `addr` lies in this PE's symmetric heap ([`Nvshmem::in_symmetric_heap`]).
    pub fn in_symmetric_heap(&self, addr: u64) -> bool {
        self.with(|r| r.in_symmetric_heap(addr))
    }
}

/// Zeroed symmetric-heap memory (`nvshmem_calloc`) that owns a handle to the runtime, freed with
/// `nvshmem_free` on drop. Creation and drop are collective: every PE allocates and frees the
/// same sizes in the same order.
#[derive(Debug)]
pub struct SymmetricAlloc {
    rt: SharedNvshmem,
    ptr: NonNull<c_void>,
    bytes: usize,
}

// SAFETY: the allocation is device memory addressed by value; every host call that touches it
// goes through the runtime's mutex.
unsafe impl Send for SymmetricAlloc {}
// SAFETY: as above; `&self` methods only read the immutable address and size.
unsafe impl Sync for SymmetricAlloc {}

impl SymmetricAlloc {
    /// `nvshmem_calloc(1, bytes)`. Collective.
    ///
    /// # Errors
    /// [`Error::ZeroSizeAlloc`]; [`Error::OutOfSymmetricMemory`].
    pub fn zeroed(rt: &SharedNvshmem, bytes: usize) -> Result<Self, Error> {
        if bytes == 0 {
            return Err(Error::ZeroSizeAlloc);
        }
        // SAFETY: the runtime is initialised (it exists).
        let p = rt.with(|r| unsafe { result::calloc(r.lib.api(), 1, bytes) });
        match p {
            Some(ptr) => Ok(Self {
                rt: rt.clone(),
                ptr,
                bytes,
            }),
            None => Err(Error::OutOfSymmetricMemory {
                call: "nvshmem_calloc",
                bytes,
            }),
        }
    }

    /// Device address of this PE's copy.
    pub fn ptr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Always false (zero-size allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Address of PE `pe`'s copy that this process can access directly (`nvshmem_ptr`), or
    /// `None` when it is not directly reachable.
    pub fn peer_ptr(&self, pe: u32) -> Option<u64> {
        self.rt.with(|r| r.peer_address(self.ptr, pe))
    }
}

impl Drop for SymmetricAlloc {
    fn drop(&mut self) {
        let ptr = self.ptr;
        // SAFETY: `ptr` came from this runtime's allocator and is freed exactly once; the
        // runtime is kept alive by `self.rt`.
        self.rt.with(|r| unsafe { result::free(r.lib.api(), ptr) });
    }
}

/// A `CUmodule` registered with NVSHMEM (`nvshmemx_cumodule_init`), unregistered
/// (`nvshmemx_cumodule_finalize`) on drop: the scoped guard a module device-linked against
/// `libnvshmem_device` needs before its kernels may call NVSHMEM. Owns a handle to the runtime.
#[derive(Debug)]
pub struct ModuleRegistration {
    rt: SharedNvshmem,
    module: NonNull<c_void>,
}

// SAFETY: the module handle is an opaque driver handle; every NVSHMEM call that uses it goes
// through the runtime's mutex.
unsafe impl Send for ModuleRegistration {}
// SAFETY: as above; `&self` methods only read the handle.
unsafe impl Sync for ModuleRegistration {}

impl ModuleRegistration {
    /// Registers `module` (a `CUmodule`, passed opaquely).
    ///
    /// # Safety
    /// `module` is live, loaded in the runtime's context from a cubin device-linked against the
    /// same NVSHMEM release, and stays loaded until this guard is dropped.
    ///
    /// # Errors
    /// [`Error::NullModule`]; [`Error::Nvshmem`] when `nvshmemx_cumodule_init` fails.
    pub unsafe fn new(rt: &SharedNvshmem, module: *mut c_void) -> Result<Self, Error> {
        let module = NonNull::new(module).ok_or(Error::NullModule)?;
        // SAFETY: initialised (the runtime exists); the module contract is the caller's.
        rt.with(|r| unsafe { result::cumodule_init(r.lib.api(), module.as_ptr()) })?;
        Ok(Self {
            rt: rt.clone(),
            module,
        })
    }

    /// The registered module.
    pub fn module(&self) -> *mut c_void {
        self.module.as_ptr()
    }
}

impl Drop for ModuleRegistration {
    fn drop(&mut self) {
        let module = self.module;
        // SAFETY: registered in `new`; still loaded (contract of `new`). A failure cannot be
        // reported from drop.
        let _ = self
            .rt
            .with(|r| unsafe { result::cumodule_finalize(r.lib.api(), module.as_ptr()) });
    }
}

/// Local, non-symmetric memory registered with NVSHMEM (`nvshmemx_buffer_register`) so that
/// RMA operations may use it as their local buffer (the source of a put): a network transport
/// (IBRC, UCX, IBGDA) can only read memory registered with the NIC. Unregistered
/// (`nvshmemx_buffer_unregister`) on drop, or checked with [`BufferRegistration::unregister`].
/// Owns a handle to the runtime, so NVSHMEM is finalised only after every registration is
/// gone. Not collective.
#[derive(Debug)]
pub struct BufferRegistration {
    rt: SharedNvshmem,
    addr: NonNull<c_void>,
    bytes: usize,
    /// Set once unregistered (by [`BufferRegistration::unregister`]): drop does nothing then.
    released: bool,
}

// SAFETY: the registration is addressed by value; every NVSHMEM call that uses it goes through
// the runtime's mutex.
unsafe impl Send for BufferRegistration {}
// SAFETY: as above; `&self` methods only read the address and length.
unsafe impl Sync for BufferRegistration {}

impl BufferRegistration {
    /// Registers `[addr, addr + bytes)`.
    ///
    /// # Safety
    /// The runtime's CUDA context is current on this thread; the range is memory of this
    /// process (device memory, or host memory NVSHMEM may pin) that stays allocated while it
    /// is registered, or, if freed earlier, is read by no put until this registration is
    /// dropped (a network transport's registration of freed pages must not serve a new
    /// allocation at the same address).
    ///
    /// # Errors
    /// [`Error::EmptyRegistration`]; [`Error::SymmetricRegistration`] for memory inside the
    /// symmetric heap (checked before any call); [`Error::Nvshmem`] naming
    /// `nvshmemx_buffer_register` when NVSHMEM refuses it (managed memory, a range overlapping
    /// one registered before, a NIC registration that failed).
    pub unsafe fn new(rt: &SharedNvshmem, addr: u64, bytes: usize) -> Result<Self, Error> {
        let Some(ptr) = NonNull::new(addr as *mut c_void).filter(|_| bytes > 0) else {
            return Err(Error::EmptyRegistration { addr, bytes });
        };
        let last = addr.saturating_add(bytes as u64 - 1);
        rt.with(|r| {
            if r.in_symmetric_heap(addr) || r.in_symmetric_heap(last) {
                return Err(Error::SymmetricRegistration { addr, bytes });
            }
            // SAFETY: initialised (the runtime exists); the range and context contract is the
            // caller's.
            unsafe { result::buffer_register(r.lib.api(), ptr.as_ptr(), bytes) }
                .map_err(Error::from)
        })?;
        Ok(Self {
            rt: rt.clone(),
            addr: ptr,
            bytes,
            released: false,
        })
    }

    /// First byte registered.
    pub fn addr(&self) -> u64 {
        self.addr.as_ptr() as u64
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Always false (empty registrations are refused).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Unregisters now, reporting a failure (dropping unregisters too, silently).
    ///
    /// # Errors
    /// [`Error::Nvshmem`] naming `nvshmemx_buffer_unregister`.
    pub fn unregister(mut self) -> Result<(), Error> {
        self.release()
    }

    /// Unregisters once; later calls do nothing.
    fn release(&mut self) -> Result<(), Error> {
        if std::mem::replace(&mut self.released, true) {
            return Ok(());
        }
        let addr = self.addr;
        // SAFETY: registered in `new` by this runtime, which `self.rt` keeps alive (not
        // finalised). A put still reading the range would fail (NVSHMEM finds no handle for
        // it, the NIC no key); nothing writes this process's memory because of it. The owner
        // drops a registration only once its puts completed.
        self.rt
            .with(|r| unsafe { result::buffer_unregister(r.lib.api(), addr.as_ptr()) })
            .map_err(Error::from)
    }
}

impl Drop for BufferRegistration {
    fn drop(&mut self) {
        // A failure cannot be reported from drop; `unregister` reports it.
        let _ = self.release();
    }
}
