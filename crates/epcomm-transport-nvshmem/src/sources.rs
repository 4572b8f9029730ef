//! Put sources in caller memory: the kernels put rows straight from the caller's arrays
//! (`nvshmemx_putmem_nbi_warp`, `nvshmemx_putmem_signal_nbi_warp` in
//! `kernels/common/net_nvshmem.cuh`), and NVSHMEM's network transports (IBRC, UCX, IBGDA) can
//! only read memory that is symmetric or registered with `nvshmemx_buffer_register`. The
//! frontend hands every such array to `SymmetricMemory::prepare_put_source` before the op is
//! launched; this module registers the whole CUDA allocation holding it, once, and keeps the
//! registration ([`epcomm_transport::sources::SourceCache`]).
//!
//! NVSHMEM's registrations are per process, and it refuses a range that overlaps one registered
//! before: so one cache serves the transport and every memory it allocates ([`PutSources`],
//! shared), and each memory is one *user* of the registrations it asked for; a registration is
//! dropped when its last user is (or when an allocation replaces it), and every one left when
//! the transport goes, before NVSHMEM is finalised (each registration holds the runtime).
//!
//! Registration happens whenever some peer is reached by put/signal, also when NVSHMEM runs
//! without a network transport (`NVSHMEM_REMOTE_TRANSPORT=none`, or every peer on this host):
//! see docs/nvshmem.md, "Put sources: caller memory registered with NVSHMEM".

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::CudaContext;
use epcomm_transport::TransportError;
use epcomm_transport::sources::{Allocation, SourceCache, SourceRegistrar, relaxed_capture};
use nvshmem_sys::{BufferRegistration, NvshmemError, SharedNvshmem, sys};

/// Where a caller range lies relative to the symmetric heap, from whether its first and its
/// last byte lie in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Inside the heap: symmetric memory, which NVSHMEM registered itself (and refuses to
    /// register again).
    Symmetric,
    /// Outside: caller memory to register.
    Local,
    /// Partly inside: no allocation does that.
    Straddles,
}

impl Placement {
    pub(crate) fn of(first_in_heap: bool, last_in_heap: bool) -> Placement {
        match (first_in_heap, last_in_heap) {
            (true, true) => Placement::Symmetric,
            (false, false) => Placement::Local,
            _ => Placement::Straddles,
        }
    }
}

/// What the rule of a refused registration adds when the driver says the allocation is not
/// GPUDirect RDMA capable (`gpudirect`: [`Allocation::gpudirect_rdma_capable`]).
fn gpudirect_hint(gpudirect: Option<bool>) -> &'static str {
    match gpudirect {
        Some(false) => {
            "; the CUDA driver says the allocation is not GPUDirect RDMA capable, so no NIC can \
             read it (memory of the stream-ordered pool, cuMemAllocAsync / cudaMallocAsync, is \
             not by default): allocate it with cuMemAlloc / cudaMalloc"
        }
        _ => "",
    }
}

/// The transport error for a registration NVSHMEM (or the safe layer) refused: the caller's
/// memory is at fault ([`TransportError::InvalidArgument`] naming `argument`) when NVSHMEM calls
/// the value invalid, the range reaches into the symmetric heap, or the driver says a NIC cannot
/// read the allocation (`gpudirect == Some(false)`, also named in the rule); anything else is
/// NVSHMEM's failure ([`TransportError::Backend`], naming the argument and the call).
pub(crate) fn registration_error(
    argument: &'static str,
    allocation: &Allocation,
    gpudirect: Option<bool>,
    error: nvshmem_sys::Error,
) -> TransportError {
    let hint = gpudirect_hint(gpudirect);
    match error {
        nvshmem_sys::Error::SymmetricRegistration { .. } => TransportError::InvalidArgument {
            argument,
            rule: format!(
                "the allocation holding it, {allocation}, reaches into the NVSHMEM symmetric \
                 heap; pass memory wholly inside or wholly outside it"
            ),
        },
        nvshmem_sys::Error::Nvshmem(e @ NvshmemError { code, .. })
            if code == sys::NVSHMEMX_ERROR_INVALID_VALUE as i32 || !hint.is_empty() =>
        {
            TransportError::InvalidArgument {
                argument,
                rule: format!(
                    "NVSHMEM puts from it, and refused to register the allocation holding it, \
                     {allocation} ({e}; NVSHMEM's message on stderr says why){hint}"
                ),
            }
        }
        other => TransportError::Backend {
            backend: "nvshmem",
            context: format!(
                "registering {argument}'s allocation {allocation} as a put source \
                 (nvshmemx_buffer_register)"
            ),
            source: Box::new(other),
        },
    }
}

/// Registers caller allocations with NVSHMEM.
#[derive(Debug)]
struct Registrar {
    rt: SharedNvshmem,
    ctx: Arc<CudaContext>,
}

impl SourceRegistrar for Registrar {
    type Registration = BufferRegistration;

    fn who(&self) -> &str {
        "NVSHMEM"
    }

    fn locate(&self, addr: u64) -> Result<Allocation, String> {
        Allocation::at(addr)
    }

    fn register(
        &self,
        argument: &'static str,
        allocation: &Allocation,
    ) -> Result<BufferRegistration, TransportError> {
        let bytes =
            usize::try_from(allocation.bytes).map_err(|_| TransportError::InvalidArgument {
                argument,
                rule: format!("the allocation holding it, {allocation}, does not fit in usize"),
            })?;
        self.ctx
            .bind_to_thread()
            .map_err(|source| TransportError::Driver {
                context: "binding the CUDA context".into(),
                source,
            })?;
        // NVSHMEM updates its device state with a blocking copy when a buffer is registered:
        // allowed while this thread captures a graph only in relaxed mode.
        // SAFETY: the context is current (bound above); the range is a whole live CUDA
        // allocation of this process (`Allocation::at`). Should the caller free it, no put reads
        // from the stale registration: the next op that puts from an allocation at that address
        // finds a new buffer id, and the cache drops this registration before registering the
        // new allocation; the cache drops every registration it holds before NVSHMEM is
        // finalised (each holds the runtime).
        relaxed_capture(|| unsafe { BufferRegistration::new(&self.rt, allocation.start, bytes) })?
            .map_err(|e| {
                registration_error(argument, allocation, allocation.gpudirect_rdma_capable(), e)
            })
    }

    fn unregister(&self, registration: BufferRegistration) {
        // Best effort: a registration NVSHMEM cannot drop is only kept until finalisation.
        let _ = self.ctx.bind_to_thread();
        let _ = relaxed_capture(move || registration.unregister());
    }
}

/// The registrations of caller memory of one NVSHMEM runtime, shared by the transport and the
/// memories it allocates; each memory is one user ([`PutSources::new_user`]). Unregisters what
/// is left when dropped, before the runtime can be finalised.
#[derive(Debug)]
pub(crate) struct PutSources {
    registrar: Registrar,
    cache: Mutex<SourceCache<BufferRegistration>>,
    next_user: AtomicU64,
}

impl PutSources {
    pub(crate) fn new(rt: SharedNvshmem, ctx: Arc<CudaContext>) -> PutSources {
        PutSources {
            registrar: Registrar { rt, ctx },
            cache: Mutex::new(SourceCache::new()),
            next_user: AtomicU64::new(0),
        }
    }

    /// A user number no other memory has.
    pub(crate) fn new_user(&self) -> u64 {
        self.next_user.fetch_add(1, Ordering::Relaxed)
    }

    /// Makes `[addr, addr + bytes)` of the caller array `argument` readable by NVSHMEM's puts,
    /// for `user`: nothing for memory in the symmetric heap, else every allocation it spans
    /// registered (once).
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `argument` for a range that wraps around,
    /// straddles the symmetric heap's bounds, or is not memory NVSHMEM can register;
    /// [`TransportError::Backend`] when NVSHMEM fails otherwise.
    pub(crate) fn prepare(
        &self,
        user: u64,
        argument: &'static str,
        addr: u64,
        bytes: usize,
    ) -> Result<(), TransportError> {
        if bytes == 0 {
            return Ok(());
        }
        let last = (bytes as u64 - 1).checked_add(addr).ok_or_else(|| {
            TransportError::InvalidArgument {
                argument,
                rule: format!("[{addr:#x}, +{bytes}) wraps around the address space"),
            }
        })?;
        let rt = &self.registrar.rt;
        match Placement::of(rt.in_symmetric_heap(addr), rt.in_symmetric_heap(last)) {
            Placement::Symmetric => return Ok(()),
            Placement::Local => {}
            Placement::Straddles => {
                return Err(TransportError::InvalidArgument {
                    argument,
                    rule: format!(
                        "[{addr:#x}, {:#x}) is partly inside the NVSHMEM symmetric heap",
                        last + 1
                    ),
                });
            }
        }
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        cache.prepare(&self.registrar, user, argument, addr, bytes as u64)?;
        Ok(())
    }

    /// Drops `user`'s claim on its registrations; those no user is left for are unregistered.
    pub(crate) fn release(&self, user: u64) {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        cache.release_user(&self.registrar, user);
    }

    /// The allocations registered, in the order they were registered.
    pub(crate) fn registered(&self) -> Vec<Allocation> {
        let cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        cache.allocations()
    }
}

impl Drop for PutSources {
    fn drop(&mut self) {
        let cache = self.cache.get_mut().unwrap_or_else(PoisonError::into_inner);
        cache.clear(&self.registrar);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Allocation = Allocation {
        start: 0x7f00_0000_0000,
        bytes: 0x20_0000,
        buffer_id: 3,
    };

    #[test]
    fn ranges_in_the_heap_are_skipped_outside_registered_and_across_refused() {
        assert_eq!(Placement::of(true, true), Placement::Symmetric);
        assert_eq!(Placement::of(false, false), Placement::Local);
        assert_eq!(Placement::of(true, false), Placement::Straddles);
        assert_eq!(Placement::of(false, true), Placement::Straddles);
    }

    #[test]
    fn an_invalid_value_names_the_argument_and_the_allocation() {
        let e = registration_error(
            "y",
            &A,
            None,
            nvshmem_sys::Error::Nvshmem(NvshmemError {
                call: "nvshmemx_buffer_register",
                code: 1,
            }),
        );
        let TransportError::InvalidArgument { argument, rule } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(*argument, "y");
        assert!(
            rule.contains("[0x7f0000000000, 0x7f0000200000)")
                && rule.contains("nvshmemx_buffer_register failed with status 1"),
            "{rule}"
        );
    }

    #[test]
    fn heap_memory_is_the_callers_fault_and_other_failures_nvshmems() {
        let e = registration_error(
            "x",
            &A,
            Some(true),
            nvshmem_sys::Error::SymmetricRegistration {
                addr: A.start,
                bytes: 64,
            },
        );
        assert!(
            matches!(&e, TransportError::InvalidArgument { argument: "x", rule } if rule.contains("symmetric heap")),
            "{e}"
        );
        let e = registration_error(
            "y_weights",
            &A,
            Some(true),
            nvshmem_sys::Error::Nvshmem(NvshmemError {
                call: "nvshmemx_buffer_register",
                code: 7,
            }),
        );
        let TransportError::Backend {
            backend, context, ..
        } = &e
        else {
            panic!("{e:?}");
        };
        assert_eq!(*backend, "nvshmem");
        assert!(
            context.contains("y_weights") && context.contains("nvshmemx_buffer_register"),
            "{context}"
        );
        assert!(e.to_string().contains("NVSHMEMX_ERROR_INTERNAL"), "{e}");
    }

    #[test]
    fn memory_no_nic_can_read_is_the_callers_fault_and_says_how_to_allocate() {
        let internal = || {
            nvshmem_sys::Error::Nvshmem(NvshmemError {
                call: "nvshmemx_buffer_register",
                code: 7,
            })
        };
        let e = registration_error("y", &A, Some(false), internal());
        let TransportError::InvalidArgument { argument, rule } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(*argument, "y");
        assert!(
            rule.contains("not GPUDirect RDMA capable") && rule.contains("cuMemAllocAsync"),
            "{rule}"
        );
        // No hint when the driver did not answer or calls it capable.
        for gpudirect in [None, Some(true)] {
            let e = registration_error("y", &A, gpudirect, internal());
            assert!(matches!(e, TransportError::Backend { .. }), "{e:?}");
        }
    }
}
