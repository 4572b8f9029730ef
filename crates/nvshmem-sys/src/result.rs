//! Thin layer: one function per NVSHMEM call, integer status turned into
//! `Result<_, NvshmemError>`. No state, no lifetimes; the callers uphold each function's
//! `# Safety` contract (the [`crate::safe`] layer does so by construction).

use std::os::raw::{c_int, c_uint, c_void};
use std::ptr::NonNull;

use crate::attr;
use crate::sys;

/// A non-zero status returned by an NVSHMEM call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed with status {code} ({})", status_name(*code))]
pub struct NvshmemError {
    /// The C function that failed.
    pub call: &'static str,
    /// Its return value (an `nvshmemx_status` when in range).
    pub code: c_int,
}

/// The `nvshmemx_status` name of `code` (`"unknown status"` when outside the enum).
pub fn status_name(code: c_int) -> &'static str {
    let Ok(c) = sys::nvshmemx_status::try_from(code) else {
        return "unknown status";
    };
    match c {
        sys::NVSHMEMX_SUCCESS => "NVSHMEMX_SUCCESS",
        sys::NVSHMEMX_ERROR_INVALID_VALUE => "NVSHMEMX_ERROR_INVALID_VALUE",
        sys::NVSHMEMX_ERROR_OUT_OF_MEMORY => "NVSHMEMX_ERROR_OUT_OF_MEMORY",
        sys::NVSHMEMX_ERROR_NOT_SUPPORTED => "NVSHMEMX_ERROR_NOT_SUPPORTED",
        sys::NVSHMEMX_ERROR_SYMMETRY => "NVSHMEMX_ERROR_SYMMETRY",
        sys::NVSHMEMX_ERROR_GPU_NOT_SELECTED => "NVSHMEMX_ERROR_GPU_NOT_SELECTED",
        sys::NVSHMEMX_ERROR_COLLECTIVE_LAUNCH_FAILED => "NVSHMEMX_ERROR_COLLECTIVE_LAUNCH_FAILED",
        sys::NVSHMEMX_ERROR_INTERNAL => "NVSHMEMX_ERROR_INTERNAL",
        _ => "unknown status",
    }
}

/// `Ok(())` for status 0, else the error naming `call`.
pub fn check(call: &'static str, code: c_int) -> Result<(), NvshmemError> {
    if code == 0 {
        Ok(())
    } else {
        Err(NvshmemError { call, code })
    }
}

/// `nvshmemx_init_status()`: one of the `sys::NVSHMEM_STATUS_*` values. Callable at any time.
pub fn init_status(api: &sys::NvshmemHost) -> c_int {
    // SAFETY: reads a global status word; valid before, during and after initialisation.
    unsafe { api.nvshmemx_init_status() }
}

/// `nvshmemx_get_uniqueid`: a fresh unique id (rank 0 makes it and ships it to the others).
///
/// # Safety
/// `api` must be a loaded NVSHMEM 3.4 host library (checked by [`crate::loader::Library`]).
pub unsafe fn get_uniqueid(
    api: &sys::NvshmemHost,
) -> Result<sys::nvshmemx_uniqueid_t, NvshmemError> {
    let mut id = attr::uniqueid_initializer();
    // SAFETY: `id` is a live, version-initialised `nvshmemx_uniqueid_t`, as the call requires.
    let code = unsafe { api.nvshmemx_get_uniqueid(&mut id) };
    check("nvshmemx_get_uniqueid", code).map(|()| id)
}

/// The Rust form of the header-only `nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, …)`:
/// `NVSHMEMX_INIT_ATTR_INITIALIZER`, then `nvshmemx_set_attr_uniqueid_args(rank, nranks, id)`,
/// then `nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr)`. Collective over all
/// `nranks` processes; blocks until they have all called it.
///
/// # Safety
/// The calling thread must have the CUDA context of the GPU this PE uses current; NVSHMEM must
/// not be initialised in this process; `0 <= rank < nranks`; every rank passes the same `id`.
pub unsafe fn init_attr_with_uniqueid(
    api: &sys::NvshmemHost,
    rank: c_int,
    nranks: c_int,
    id: &sys::nvshmemx_uniqueid_t,
) -> Result<(), NvshmemError> {
    let mut attr = attr::init_attr_initializer();
    // SAFETY: `id` and `attr` are live and version-initialised; the call stores `id`'s address
    // in `attr`, which is only used by the init call below while `id` is still borrowed.
    let code = unsafe { api.nvshmemx_set_attr_uniqueid_args(rank, nranks, id, &mut attr) };
    check("nvshmemx_set_attr_uniqueid_args", code)?;
    let flags = sys::NVSHMEMX_INIT_WITH_UNIQUEID as c_uint;
    // SAFETY: `attr` holds valid unique-id arguments; the caller upholds the context and
    // once-per-process requirements.
    let code = unsafe { api.nvshmemx_hostlib_init_attr(flags, &mut attr) };
    check("nvshmemx_hostlib_init_attr", code)
}

/// `nvshmemx_hostlib_finalize()`. Collective.
///
/// # Safety
/// NVSHMEM must be initialised, and no symmetric memory or registered module may be used after.
pub unsafe fn hostlib_finalize(api: &sys::NvshmemHost) {
    // SAFETY: upheld by the caller.
    unsafe { api.nvshmemx_hostlib_finalize() }
}

/// `nvshmem_my_pe()`.
///
/// # Safety
/// NVSHMEM must be initialised.
pub unsafe fn my_pe(api: &sys::NvshmemHost) -> c_int {
    // SAFETY: upheld by the caller.
    unsafe { api.nvshmem_my_pe() }
}

/// `nvshmem_n_pes()`.
///
/// # Safety
/// NVSHMEM must be initialised.
pub unsafe fn n_pes(api: &sys::NvshmemHost) -> c_int {
    // SAFETY: upheld by the caller.
    unsafe { api.nvshmem_n_pes() }
}

/// `nvshmem_team_my_pe(team)`: this PE's index in `team`, -1 when not a member.
///
/// # Safety
/// NVSHMEM must be initialised and `team` a valid team handle (e.g. `NVSHMEM_TEAM_WORLD`).
pub unsafe fn team_my_pe(api: &sys::NvshmemHost, team: sys::nvshmem_team_t) -> c_int {
    // SAFETY: upheld by the caller.
    unsafe { api.nvshmem_team_my_pe(team) }
}

/// `nvshmem_team_n_pes(team)`: the team's size, -1 for an invalid team.
///
/// # Safety
/// NVSHMEM must be initialised and `team` a valid team handle.
pub unsafe fn team_n_pes(api: &sys::NvshmemHost, team: sys::nvshmem_team_t) -> c_int {
    // SAFETY: upheld by the caller.
    unsafe { api.nvshmem_team_n_pes(team) }
}

/// `nvshmem_malloc(bytes)`; `None` when NVSHMEM returns NULL. Collective: every PE calls it with
/// the same size.
///
/// # Safety
/// NVSHMEM must be initialised.
pub unsafe fn malloc(api: &sys::NvshmemHost, bytes: usize) -> Option<NonNull<c_void>> {
    // SAFETY: upheld by the caller.
    NonNull::new(unsafe { api.nvshmem_malloc(bytes) })
}

/// `nvshmem_align(alignment, bytes)`; `None` on NULL. Collective.
///
/// # Safety
/// NVSHMEM must be initialised; `alignment` a power of two.
pub unsafe fn align(
    api: &sys::NvshmemHost,
    alignment: usize,
    bytes: usize,
) -> Option<NonNull<c_void>> {
    // SAFETY: upheld by the caller.
    NonNull::new(unsafe { api.nvshmem_align(alignment, bytes) })
}

/// `nvshmem_calloc(count, size)`; `None` on NULL. Collective.
///
/// # Safety
/// NVSHMEM must be initialised.
pub unsafe fn calloc(api: &sys::NvshmemHost, count: usize, size: usize) -> Option<NonNull<c_void>> {
    // SAFETY: upheld by the caller.
    NonNull::new(unsafe { api.nvshmem_calloc(count, size) })
}

/// `nvshmem_free(ptr)`. Collective (includes a barrier).
///
/// # Safety
/// `ptr` came from `malloc`/`align`/`calloc` of this runtime and is not used afterwards.
pub unsafe fn free(api: &sys::NvshmemHost, ptr: NonNull<c_void>) {
    // SAFETY: upheld by the caller.
    unsafe { api.nvshmem_free(ptr.as_ptr()) }
}

/// `nvshmem_ptr(ptr, pe)`: the address at which this process can load/store `pe`'s copy of the
/// symmetric object at `ptr`; `None` when `pe` is not directly reachable (not P2P/NVLink), and
/// for a `ptr` outside the symmetric heap (the host library compares `ptr` with the heap's
/// bounds and dereferences nothing, so any address may be asked about).
///
/// # Safety
/// NVSHMEM must be initialised; `0 <= pe < n_pes`.
pub unsafe fn ptr(
    api: &sys::NvshmemHost,
    ptr: *const c_void,
    pe: c_int,
) -> Option<NonNull<c_void>> {
    // SAFETY: upheld by the caller.
    NonNull::new(unsafe { api.nvshmem_ptr(ptr, pe) })
}

/// `nvshmemx_buffer_register(addr, length)`: registers `[addr, addr + length)` of local,
/// non-symmetric memory with every transport NVSHMEM initialised, so that RMA operations may
/// use it as their local buffer (a network transport registers it with the NIC; the P2P
/// transport only records the range). Not collective.
///
/// NVSHMEM 3.4 refuses (`NVSHMEMX_ERROR_INVALID_VALUE`) a zero length, managed memory, memory
/// inside the symmetric heap (registered already), and a range overlapping, or starting at the
/// same address as, one registered before.
///
/// # Safety
/// NVSHMEM must be initialised and the calling thread must have the runtime's CUDA context
/// current; the range must be memory of this process that stays allocated until it is
/// unregistered with [`buffer_unregister`] (a network transport keeps a NIC registration of
/// its pages).
pub unsafe fn buffer_register(
    api: &sys::NvshmemHost,
    addr: *mut c_void,
    length: usize,
) -> Result<(), NvshmemError> {
    // SAFETY: upheld by the caller.
    let code = unsafe { api.nvshmemx_buffer_register(addr, length) };
    check("nvshmemx_buffer_register", code)
}

/// `nvshmemx_buffer_unregister(addr)`: undoes [`buffer_register`] of the range starting at
/// `addr`. `NVSHMEMX_ERROR_INVALID_VALUE` when no registered range starts there.
///
/// # Safety
/// NVSHMEM must be initialised (not finalised yet); no RMA operation still in flight uses the
/// range as its local buffer.
pub unsafe fn buffer_unregister(
    api: &sys::NvshmemHost,
    addr: *mut c_void,
) -> Result<(), NvshmemError> {
    // SAFETY: upheld by the caller.
    let code = unsafe { api.nvshmemx_buffer_unregister(addr) };
    check("nvshmemx_buffer_unregister", code)
}

/// `nvshmem_barrier_all()`: host-side barrier over all PEs, completing prior puts.
///
/// # Safety
/// NVSHMEM must be initialised; every PE must call it.
pub unsafe fn barrier_all(api: &sys::NvshmemHost) {
    // SAFETY: upheld by the caller.
    unsafe { api.nvshmem_barrier_all() }
}

/// `nvshmemx_barrier_all_on_stream(stream)`.
///
/// # Safety
/// NVSHMEM must be initialised; `stream` is a live `CUstream`/`cudaStream_t` (or null for the
/// legacy default stream) of the current context; every PE must call it.
pub unsafe fn barrier_all_on_stream(api: &sys::NvshmemHost, stream: *mut c_void) {
    // SAFETY: upheld by the caller; `cudaStream_t` and `CUstream` are the same opaque pointer.
    unsafe { api.nvshmemx_barrier_all_on_stream(stream.cast()) }
}

/// `nvshmem_quiet()`: waits for completion of this PE's outstanding puts/AMOs.
///
/// # Safety
/// NVSHMEM must be initialised.
pub unsafe fn quiet(api: &sys::NvshmemHost) {
    // SAFETY: upheld by the caller.
    unsafe { api.nvshmem_quiet() }
}

/// `nvshmemx_quiet_on_stream(stream)`.
///
/// # Safety
/// As [`barrier_all_on_stream`], except that it is not collective.
pub unsafe fn quiet_on_stream(api: &sys::NvshmemHost, stream: *mut c_void) {
    // SAFETY: upheld by the caller.
    unsafe { api.nvshmemx_quiet_on_stream(stream.cast()) }
}

/// `nvshmemx_cumodule_init(module)`: binds the module's NVSHMEM device state.
///
/// # Safety
/// NVSHMEM must be initialised; `module` is a live `CUmodule` device-linked against
/// `libnvshmem_device`, loaded in the current context.
pub unsafe fn cumodule_init(
    api: &sys::NvshmemHost,
    module: *mut c_void,
) -> Result<(), NvshmemError> {
    // SAFETY: upheld by the caller.
    let code = unsafe { api.nvshmemx_cumodule_init(module.cast()) };
    check("nvshmemx_cumodule_init", code)
}

/// `nvshmemx_cumodule_finalize(module)`.
///
/// # Safety
/// `module` was registered with [`cumodule_init`] and is still loaded; no kernel of it using
/// NVSHMEM runs afterwards.
pub unsafe fn cumodule_finalize(
    api: &sys::NvshmemHost,
    module: *mut c_void,
) -> Result<(), NvshmemError> {
    // SAFETY: upheld by the caller.
    let code = unsafe { api.nvshmemx_cumodule_finalize(module.cast()) };
    check("nvshmemx_cumodule_finalize", code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_is_success_and_anything_else_names_the_call_and_status() {
        assert_eq!(check("nvshmem_x", 0), Ok(()));
        let e = check("nvshmemx_hostlib_init_attr", 7).unwrap_err();
        assert_eq!(
            e,
            NvshmemError {
                call: "nvshmemx_hostlib_init_attr",
                code: 7
            }
        );
        assert_eq!(
            e.to_string(),
            "nvshmemx_hostlib_init_attr failed with status 7 (NVSHMEMX_ERROR_INTERNAL)"
        );
        assert!(
            check("f", -1)
                .unwrap_err()
                .to_string()
                .contains("unknown status")
        );
        assert_eq!(status_name(1), "NVSHMEMX_ERROR_INVALID_VALUE");
        assert_eq!(status_name(99), "unknown status");
    }
}
