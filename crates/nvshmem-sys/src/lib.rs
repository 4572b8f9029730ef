//! Runtime-loaded bindings to the NVSHMEM 3.4 **host** library (`libnvshmem_host.so.3`).
//!
//! Nothing links at build time and no build script runs: the library is `dlopen`ed when
//! [`loader::load`] is called. Three layers, as in cudarc's driver API:
//!
//! * [`sys`] — bindgen output, vendored (`src/bindings.rs`, regenerated and checked only by
//!   `cargo xtask bindgen-nvshmem [--check]`): the C types, constants and
//!   [`sys::NvshmemHost`], a struct of the function pointers bound.
//! * [`result`] — one thin, `unsafe` function per call that turns NVSHMEM's integer status into
//!   `Result<_, NvshmemError>`; plus [`attr`], Rust versions of the header-only initialisers.
//! * [`safe`] — [`Nvshmem`] (an initialised runtime, finalised on drop), [`SymmetricAlloc`]
//!   (RAII symmetric-heap memory), [`ModuleRegistration`] (scoped
//!   `nvshmemx_cumodule_init`/`finalize`) and [`BufferRegistration`] (scoped
//!   `nvshmemx_buffer_register`/`unregister` of local memory puts read from).
//!
//! The `static inline` initialisers of the headers (`nvshmem_init`, `nvshmemx_init_attr`) call
//! symbols that live in the *device* archive, so they are not bound; initialisation goes through
//! `nvshmemx_set_attr_uniqueid_args` + `nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID)`.
//! See `docs/nvshmem.md`.
//!
//! # Examples
//!
//! The unique id travels between ranks as bytes; that part needs no library and no GPU:
//!
//! ```
//! use nvshmem_sys::{UNIQUEID_BYTES, UniqueIdError, attr};
//!
//! let id = attr::uniqueid_initializer();
//! let bytes = attr::uniqueid_to_bytes(&id);
//! assert_eq!(bytes.len(), UNIQUEID_BYTES);
//! assert!(attr::uniqueid_from_bytes(&bytes).is_ok());
//! // Anything else is rejected with a typed error.
//! assert!(matches!(
//!     attr::uniqueid_from_bytes(&bytes[..16]),
//!     Err(UniqueIdError::Length { expected: 128, found: 16 })
//! ));
//! ```
//!
//! Loading the host library needs NVSHMEM 3.4 installed (and, to initialise it, a GPU):
//!
//! ```no_run
//! let lib = nvshmem_sys::loader::load_default()?;
//! println!("NVSHMEM {} from {}", lib.version(), lib.path().display());
//! # Ok::<(), nvshmem_sys::LoadError>(())
//! ```

/// The bindgen output (vendored; see the crate documentation).
#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    missing_debug_implementations,
    unsafe_op_in_unsafe_fn,
    clippy::undocumented_unsafe_blocks,
    clippy::missing_safety_doc,
    clippy::too_many_arguments
)]
#[path = "bindings.rs"]
pub mod sys;

pub mod attr;
pub mod loader;
pub mod result;
pub mod safe;

pub use attr::{UNIQUEID_BYTES, UniqueIdError};
pub use loader::{Library, LibrarySearch, LoadError, Version};
pub use result::NvshmemError;
pub use safe::{
    BufferRegistration, Error, ModuleRegistration, Nvshmem, SharedNvshmem, SymmetricAlloc, Team,
};
