//! Caller memory that a backend's puts read ("put sources", see
//! [`SymmetricMemory::prepare_put_source`](crate::SymmetricMemory::prepare_put_source)), for the
//! backends whose network library must register such memory before it reads it (`proxy-verbs`:
//! the NIC; `nvshmem`: `nvshmemx_buffer_register`).
//!
//! * [`Allocation::at`]: the whole CUDA allocation holding an address, with the driver's
//!   buffer id, which tells a new allocation at the address of a freed one from the old one.
//! * [`SourceCache`]: registrations by allocation. An op's array is registered the first time
//!   an op puts from it, as the whole allocation holding it (a caching allocator hands out
//!   slices of a few large allocations, so a handful of registrations serve every later op);
//!   an allocation freed and replaced is registered again, and the old registration dropped.
//!   The backend's side (where the allocation is, how to register it, how to undo that) is a
//!   [`SourceRegistrar`], so the cache itself is plain data and tested without a GPU.
//! * [`relaxed_capture`]: runs a registration while this thread captures a CUDA graph (a
//!   library call that synchronises would otherwise invalidate the capture).

use std::fmt;

use cudarc::driver::sys;

use crate::TransportError;

/// A CUDA allocation, as the driver reports it (or widened by a backend, e.g. to whole pages).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Allocation {
    /// First byte.
    pub start: u64,
    /// Size in bytes (non-zero).
    pub bytes: u64,
    /// The driver's process-unique id of the allocation (`CU_POINTER_ATTRIBUTE_BUFFER_ID`): an
    /// allocation made where a freed one was gets a new id.
    pub buffer_id: u64,
}

impl Allocation {
    /// One past the last byte (saturating at the top of the address space).
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.bytes)
    }

    /// Whether `addr` lies inside.
    pub fn contains(&self, addr: u64) -> bool {
        self.start <= addr && addr < self.end()
    }

    /// Whether the two byte ranges share a byte.
    pub fn overlaps(&self, other: &Allocation) -> bool {
        self.start < other.end() && other.start < self.end()
    }

    /// The same allocation widened to whole `page`s: start rounded down, end rounded up (a
    /// `page` of 0 or 1 changes nothing).
    pub fn page_aligned(self, page: u64) -> Allocation {
        if page <= 1 {
            return self;
        }
        let start = self.start / page * page;
        let end = self.end().div_ceil(page).saturating_mul(page);
        Allocation {
            start,
            bytes: end - start,
            buffer_id: self.buffer_id,
        }
    }

    /// The CUDA allocation holding `addr`, asked of the driver (`cuPointerGetAttribute`:
    /// range start, range size, buffer id). The thread needs no current context.
    ///
    /// # Errors
    /// Why it cannot serve as a put source: memory the driver does not know, managed (unified)
    /// memory (it migrates, and a NIC cannot register it), or a range that does not hold
    /// `addr`.
    pub fn at(addr: u64) -> Result<Allocation, String> {
        let mut managed: u64 = 0;
        // SAFETY: IS_MANAGED writes one boolean of at most 4 bytes into the live, zeroed u64
        // it is given (so any non-zero value means true); the query only reads the driver's
        // table of allocations.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut managed as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
                addr,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!(
                "the CUDA driver does not know the address (cuPointerGetAttribute: {r:?})"
            ));
        }
        if managed != 0 {
            return Err(
                "it is managed (unified) memory, which migrates between host and device and \
                 cannot be registered for a NIC; use device memory"
                    .into(),
            );
        }
        let mut start: u64 = 0;
        let mut size: u64 = 0;
        let mut id: u64 = 0;
        for (out, attribute) in [
            (
                &mut start,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            ),
            (
                &mut size,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            ),
            (
                &mut id,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
            ),
        ] {
            // SAFETY: each of these attributes writes one 64-bit value (a CUdeviceptr, a
            // size_t, an unsigned long long) into the live u64 it is given; the query only
            // reads the driver's table of allocations.
            let r =
                unsafe { sys::cuPointerGetAttribute((out as *mut u64).cast(), attribute, addr) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(format!(
                    "cuPointerGetAttribute({attribute:?}) failed: {r:?}"
                ));
            }
        }
        let allocation = Allocation {
            start,
            bytes: size,
            buffer_id: id,
        };
        if size == 0 || !allocation.contains(addr) {
            return Err(format!(
                "the driver reported the range [{start:#x}, +{size}) for address {addr:#x}"
            ));
        }
        Ok(allocation)
    }
}

impl Allocation {
    /// Whether the driver calls the allocation GPUDirect RDMA capable
    /// (`CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`): `Some(false)` means a NIC cannot
    /// register it, as for memory of the default stream-ordered pool (`cuMemAllocAsync`,
    /// which cudarc uses where the GPU supports it); `cuMemAlloc` memory is. `None` when the
    /// driver does not answer. For error messages: the query costs a driver call.
    pub fn gpudirect_rdma_capable(&self) -> Option<bool> {
        let mut capable: u64 = 0;
        // SAFETY: the attribute writes one boolean of at most 4 bytes into the live, zeroed
        // u64 it is given; the query only reads the driver's table of allocations.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut capable as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
                self.start,
            )
        };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(capable != 0)
    }
}

impl fmt::Display for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{:#x}, {:#x})", self.start, self.end())
    }
}

/// A backend's side of [`SourceCache`]: where caller memory lies, and how its network library
/// registers and unregisters it.
pub trait SourceRegistrar {
    /// What a registration leaves to undo (a key, or an RAII guard).
    type Registration;

    /// Who puts from the memory, for errors: "`{who}` puts from it, so ...".
    fn who(&self) -> &str;

    /// The allocation holding `addr`, as the cache keys and registers it (usually
    /// [`Allocation::at`], possibly widened); `Err(why)` when it cannot be registered.
    fn locate(&self, addr: u64) -> Result<Allocation, String>;

    /// Registers `allocation`, which holds (part of) the caller's array `argument`.
    ///
    /// # Errors
    /// A [`TransportError`] naming `argument` (or the backend's own error).
    fn register(
        &self,
        argument: &'static str,
        allocation: &Allocation,
    ) -> Result<Self::Registration, TransportError>;

    /// Undoes a registration (its allocation was replaced, or no user is left).
    fn unregister(&self, registration: Self::Registration);
}

/// Caller allocations registered as put sources, by range and buffer id, each with the users
/// (numbers the owner chooses, e.g. one per symmetric memory) that asked for it. A
/// registration is kept until its last user is released ([`SourceCache::release_user`]), the
/// cache is cleared, or a new allocation overlaps it (the old one was freed, since live
/// allocations never overlap).
pub struct SourceCache<R> {
    entries: Vec<CachedSource<R>>,
}

struct CachedSource<R> {
    allocation: Allocation,
    users: Vec<u64>,
    registration: R,
}

impl<R> fmt::Debug for SourceCache<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|e| (e.allocation, &e.users)))
            .finish()
    }
}

impl<R> Default for SourceCache<R> {
    fn default() -> Self {
        Self::new()
    }
}

impl<R> SourceCache<R> {
    /// An empty cache.
    pub const fn new() -> Self {
        Self {
            entries: Vec::new(),
        }
    }

    /// Makes every allocation overlapping `[addr, addr + bytes)` registered, for `user`:
    /// registers those not registered yet (or replaced since), and records `user` on each.
    /// Returns how many registrations were made (0 when all were cached). Empty ranges
    /// register nothing.
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `argument` when the range wraps around, or
    /// part of it is not memory the backend can register (`locate` failed, or reported an
    /// allocation that does not hold the address asked about); `register`'s errors. The
    /// allocations before the failing one stay registered.
    pub fn prepare<G>(
        &mut self,
        registrar: &G,
        user: u64,
        argument: &'static str,
        addr: u64,
        bytes: u64,
    ) -> Result<usize, TransportError>
    where
        G: SourceRegistrar<Registration = R> + ?Sized,
    {
        let end = addr
            .checked_add(bytes)
            .ok_or_else(|| TransportError::InvalidArgument {
                argument,
                rule: format!("[{addr:#x}, +{bytes}) wraps around the address space"),
            })?;
        let unusable = |cursor: u64, why: String| TransportError::InvalidArgument {
            argument,
            rule: format!(
                "{} puts from it, so it must be CUDA device memory it can register: address \
                 {cursor:#x}: {why}",
                registrar.who()
            ),
        };
        let mut made = 0;
        let mut cursor = addr;
        while cursor < end {
            let allocation = registrar
                .locate(cursor)
                .map_err(|why| unusable(cursor, why))?;
            if !allocation.contains(cursor) {
                // Also what keeps this loop moving forward.
                return Err(unusable(
                    cursor,
                    format!("the allocation found for it, {allocation}, does not hold it"),
                ));
            }
            cursor = allocation.end();
            if let Some(e) = self.entries.iter_mut().find(|e| e.allocation == allocation) {
                if !e.users.contains(&user) {
                    e.users.push(user);
                }
                continue;
            }
            // A new allocation: what is registered where it lies belongs to allocations freed
            // since, and must not serve its addresses any longer.
            self.drop_where(registrar, |e| e.allocation.overlaps(&allocation));
            let registration = registrar.register(argument, &allocation)?;
            self.entries.push(CachedSource {
                allocation,
                users: vec![user],
                registration,
            });
            made += 1;
        }
        Ok(made)
    }

    /// Forgets `user`; unregisters the allocations no user is left for. Returns how many were
    /// unregistered.
    pub fn release_user<G>(&mut self, registrar: &G, user: u64) -> usize
    where
        G: SourceRegistrar<Registration = R> + ?Sized,
    {
        for e in &mut self.entries {
            e.users.retain(|&u| u != user);
        }
        self.drop_where(registrar, |e| e.users.is_empty())
    }

    /// Unregisters everything.
    pub fn clear<G>(&mut self, registrar: &G)
    where
        G: SourceRegistrar<Registration = R> + ?Sized,
    {
        self.drop_where(registrar, |_| true);
    }

    /// The allocations registered, in the order they were registered.
    pub fn allocations(&self) -> Vec<Allocation> {
        self.entries.iter().map(|e| e.allocation).collect()
    }

    /// Number of registrations held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn drop_where<G>(&mut self, registrar: &G, stale: impl Fn(&CachedSource<R>) -> bool) -> usize
    where
        G: SourceRegistrar<Registration = R> + ?Sized,
    {
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|e| stale(e));
        self.entries = kept;
        let n = gone.len();
        for e in gone {
            registrar.unregister(e.registration);
        }
        n
    }
}

/// Runs `f` with this thread's stream-capture mode relaxed
/// (`cuThreadExchangeStreamCaptureMode(RELAXED)`), and restores the mode after.
///
/// While a stream of this thread captures a CUDA graph in global or thread-local mode, calls
/// that may synchronise (a blocking `cudaMemcpy`, as NVSHMEM makes to update its device state
/// when a buffer is registered) are refused and invalidate the capture. Registering caller
/// memory is such a call, and it is made before the op that puts from it is captured; it is
/// not part of the graph, and the registration outlives the capture. Outside a capture the
/// exchange changes nothing.
///
/// # Errors
/// [`TransportError::Driver`] when the mode cannot be exchanged; `f` did not run then.
pub fn relaxed_capture<T>(f: impl FnOnce() -> T) -> Result<T, TransportError> {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a live CUstreamCaptureMode; the call swaps it with this thread's mode.
    unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }
        .result()
        .map_err(|source| TransportError::Driver {
            context: "relaxing the thread's stream-capture mode".into(),
            source,
        })?;
    let out = f();
    // SAFETY: as above; `mode` now holds the thread's previous mode, which this restores.
    unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }
        .result()
        .map_err(|source| TransportError::Driver {
            context: "restoring the thread's stream-capture mode".into(),
            source,
        })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// Allocations by hand; registrations numbered; every call logged.
    #[derive(Default)]
    struct Fake {
        allocations: RefCell<Vec<Allocation>>,
        next: RefCell<u32>,
        log: RefCell<Vec<String>>,
        refuse: RefCell<Option<u64>>,
        /// Pretend the driver answers with this allocation for every address.
        lie: RefCell<Option<Allocation>>,
    }

    fn alloc(start: u64, bytes: u64, buffer_id: u64) -> Allocation {
        Allocation {
            start,
            bytes,
            buffer_id,
        }
    }

    impl Fake {
        fn with(allocations: &[Allocation]) -> Fake {
            let f = Fake::default();
            f.allocations.borrow_mut().extend_from_slice(allocations);
            f
        }

        /// The caller frees everything at `start` and allocates `a` instead.
        fn replace(&self, a: Allocation) {
            let mut all = self.allocations.borrow_mut();
            all.retain(|b| !b.overlaps(&a));
            all.push(a);
        }

        fn log(&self) -> Vec<String> {
            std::mem::take(&mut *self.log.borrow_mut())
        }
    }

    impl SourceRegistrar for Fake {
        type Registration = (u32, Allocation);

        fn who(&self) -> &str {
            "the fake transport"
        }

        fn locate(&self, addr: u64) -> Result<Allocation, String> {
            if let Some(a) = *self.lie.borrow() {
                return Ok(a);
            }
            self.allocations
                .borrow()
                .iter()
                .copied()
                .find(|a| a.contains(addr))
                .ok_or_else(|| "not device memory".to_string())
        }

        fn register(
            &self,
            argument: &'static str,
            a: &Allocation,
        ) -> Result<(u32, Allocation), TransportError> {
            if *self.refuse.borrow() == Some(a.start) {
                return Err(TransportError::InvalidArgument {
                    argument,
                    rule: format!("refused {a}"),
                });
            }
            let mut n = self.next.borrow_mut();
            *n += 1;
            self.log
                .borrow_mut()
                .push(format!("reg {a} #{}", a.buffer_id));
            Ok((*n, *a))
        }

        fn unregister(&self, (_, a): (u32, Allocation)) {
            self.log
                .borrow_mut()
                .push(format!("unreg {a} #{}", a.buffer_id));
        }
    }

    #[test]
    fn the_whole_allocation_is_registered_once_and_then_served_from_the_cache() {
        let f = Fake::with(&[alloc(0x1000, 0x1000, 7)]);
        let mut c = SourceCache::new();
        assert_eq!(c.prepare(&f, 1, "x", 0x1100, 0x10).unwrap(), 1);
        assert_eq!(f.log(), ["reg [0x1000, 0x2000) #7"]);
        // Any part of it again, by this user or another: nothing to do.
        assert_eq!(c.prepare(&f, 1, "x", 0x1100, 0x10).unwrap(), 0);
        assert_eq!(c.prepare(&f, 2, "y", 0x1000, 0x1000).unwrap(), 0);
        assert!(f.log().is_empty());
        assert_eq!(c.allocations(), [alloc(0x1000, 0x1000, 7)]);
    }

    #[test]
    fn a_range_spanning_allocations_registers_each() {
        let f = Fake::with(&[alloc(0x1000, 0x1000, 1), alloc(0x2000, 0x800, 2)]);
        let mut c = SourceCache::new();
        assert_eq!(c.prepare(&f, 1, "x", 0x1ff0, 0x20).unwrap(), 2);
        assert_eq!(
            f.log(),
            ["reg [0x1000, 0x2000) #1", "reg [0x2000, 0x2800) #2"]
        );
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn an_allocation_freed_and_made_again_at_the_same_address_is_registered_again() {
        let f = Fake::with(&[alloc(0x1000, 0x1000, 1)]);
        let mut c = SourceCache::new();
        c.prepare(&f, 1, "x", 0x1000, 0x10).unwrap();
        f.log();
        f.replace(alloc(0x1000, 0x1000, 2));
        assert_eq!(c.prepare(&f, 1, "x", 0x1000, 0x10).unwrap(), 1);
        // The old registration goes first: a library that refuses overlapping ranges
        // (NVSHMEM) accepts the new one.
        assert_eq!(
            f.log(),
            ["unreg [0x1000, 0x2000) #1", "reg [0x1000, 0x2000) #2"]
        );
        assert_eq!(c.allocations(), [alloc(0x1000, 0x1000, 2)]);
    }

    #[test]
    fn a_new_allocation_over_part_of_a_freed_one_drops_only_what_it_overlaps() {
        let f = Fake::with(&[alloc(0x1000, 0x2000, 1), alloc(0x8000, 0x1000, 2)]);
        let mut c = SourceCache::new();
        c.prepare(&f, 1, "x", 0x1000, 0x10).unwrap();
        c.prepare(&f, 1, "y", 0x8000, 0x10).unwrap();
        f.log();
        f.replace(alloc(0x2000, 0x800, 3));
        assert_eq!(c.prepare(&f, 1, "x", 0x2400, 0x10).unwrap(), 1);
        assert_eq!(
            f.log(),
            ["unreg [0x1000, 0x3000) #1", "reg [0x2000, 0x2800) #3"]
        );
        assert_eq!(
            c.allocations(),
            [alloc(0x8000, 0x1000, 2), alloc(0x2000, 0x800, 3)]
        );
    }

    #[test]
    fn registrations_live_until_their_last_user_is_released() {
        let f = Fake::with(&[alloc(0x1000, 0x1000, 1), alloc(0x4000, 0x1000, 2)]);
        let mut c = SourceCache::new();
        c.prepare(&f, 1, "x", 0x1000, 0x10).unwrap();
        c.prepare(&f, 2, "x", 0x1000, 0x10).unwrap();
        c.prepare(&f, 2, "y", 0x4000, 0x10).unwrap();
        f.log();
        assert_eq!(c.release_user(&f, 9), 0, "an unknown user releases nothing");
        assert_eq!(c.release_user(&f, 2), 1);
        assert_eq!(f.log(), ["unreg [0x4000, 0x5000) #2"]);
        assert_eq!(c.allocations(), [alloc(0x1000, 0x1000, 1)]);
        assert_eq!(c.release_user(&f, 1), 1);
        assert_eq!(f.log(), ["unreg [0x1000, 0x2000) #1"]);
        assert!(c.is_empty());
    }

    #[test]
    fn clear_unregisters_everything() {
        let f = Fake::with(&[alloc(0x1000, 0x1000, 1), alloc(0x4000, 0x1000, 2)]);
        let mut c = SourceCache::new();
        c.prepare(&f, 1, "x", 0x1000, 0x10).unwrap();
        c.prepare(&f, 2, "y", 0x4000, 0x10).unwrap();
        f.log();
        c.clear(&f);
        assert_eq!(
            f.log(),
            ["unreg [0x1000, 0x2000) #1", "unreg [0x4000, 0x5000) #2"]
        );
        assert!(c.is_empty());
    }

    #[test]
    fn memory_that_cannot_be_located_is_an_error_naming_the_argument_and_address() {
        let f = Fake::with(&[alloc(0x1000, 0x1000, 1)]);
        let mut c = SourceCache::new();
        // The first allocation is registered, the gap after it is not memory.
        let e = c.prepare(&f, 1, "y_weights", 0x1f00, 0x200).unwrap_err();
        let TransportError::InvalidArgument { argument, rule } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(*argument, "y_weights");
        assert_eq!(
            rule,
            "the fake transport puts from it, so it must be CUDA device memory it can register: \
             address 0x2000: not device memory"
        );
        assert_eq!(c.allocations(), [alloc(0x1000, 0x1000, 1)]);
    }

    #[test]
    fn an_allocation_that_does_not_hold_the_address_is_refused_not_looped_on() {
        let f = Fake::default();
        *f.lie.borrow_mut() = Some(alloc(0x1000, 0x100, 1));
        let mut c = SourceCache::<(u32, Allocation)>::new();
        let e = c.prepare(&f, 1, "x", 0x1100, 0x10).unwrap_err();
        assert!(
            e.to_string()
                .contains("the allocation found for it, [0x1000, 0x1100), does not hold it"),
            "{e}"
        );
        assert!(c.is_empty() && f.log().is_empty());
    }

    #[test]
    fn wrapping_ranges_are_refused_and_empty_ones_register_nothing() {
        let f = Fake::with(&[alloc(0x1000, 0x1000, 1)]);
        let mut c = SourceCache::new();
        let e = c.prepare(&f, 1, "x", u64::MAX - 4, 8).unwrap_err();
        assert!(
            matches!(&e, TransportError::InvalidArgument { argument: "x", rule } if rule.contains("wraps around")),
            "{e}"
        );
        assert_eq!(c.prepare(&f, 1, "x", 0x1000, 0).unwrap(), 0);
        assert!(c.is_empty() && f.log().is_empty());
    }

    #[test]
    fn a_failed_registration_is_not_cached() {
        let f = Fake::with(&[alloc(0x1000, 0x1000, 1)]);
        *f.refuse.borrow_mut() = Some(0x1000);
        let mut c = SourceCache::new();
        let e = c.prepare(&f, 1, "x", 0x1000, 0x10).unwrap_err();
        assert!(e.to_string().contains("refused [0x1000, 0x2000)"), "{e}");
        assert!(c.is_empty());
        *f.refuse.borrow_mut() = None;
        assert_eq!(c.prepare(&f, 1, "x", 0x1000, 0x10).unwrap(), 1);
    }

    #[test]
    fn ranges_widen_to_whole_pages_and_compare_by_bytes() {
        let a = alloc(0x1234, 0x100, 5);
        assert_eq!(a.page_aligned(0x1000), alloc(0x1000, 0x1000, 5));
        assert_eq!(alloc(0x1000, 0x1001, 5).page_aligned(0x1000).bytes, 0x2000);
        assert_eq!(a.page_aligned(1), a);
        assert_eq!(a.page_aligned(0), a);
        assert!(a.contains(0x1234) && a.contains(0x1333) && !a.contains(0x1334));
        assert!(!a.contains(0x1233));
        assert!(a.overlaps(&alloc(0x1333, 1, 0)) && !a.overlaps(&alloc(0x1334, 8, 0)));
        assert!(!a.overlaps(&alloc(0x1000, 0x234, 0)));
        assert_eq!(a.to_string(), "[0x1234, 0x1334)");
        assert_eq!(alloc(u64::MAX - 1, 8, 0).end(), u64::MAX);
    }
}
