//! RDMA through `libibverbs.so.1`, opened at run time: device enumeration, and
//! [`VerbsExecutor`], the proxy's executor over one RC queue pair per peer.
//!
//! Nothing links at build time (the `ibverbs`/`ibverbs-sys` crates emit
//! `cargo:rustc-link-lib=ibverbs`, which would make every binary fail to start where
//! libibverbs is missing); the library is `dlopen`ed by [`Verbs::load`] and only the calls
//! bound in [`sys`] are used: the device list (`ibv_get_device_list`, `ibv_free_device_list`,
//! `ibv_get_device_name`, `ibv_get_device_guid`) and what an RC queue pair needs (see [`sys`]
//! for `ibv_post_send`/`ibv_poll_cq`, which are inline in `verbs.h`, and `ibv_query_port`,
//! a macro there).
//!
//! [`Verbs::load_default`] looks in these places, in order; the first file that exists is
//! opened (if it then fails to load, that error is returned and the search stops):
//!
//! 1. `$EPCOMM_IBVERBS_LIB`: the library file, or the directory holding `libibverbs.so.1`;
//! 2. the bare soname `libibverbs.so.1` through the system's dynamic loader
//!    (`LD_LIBRARY_PATH`, `ld.so.cache`, the default directories).
//!
//! When nothing is found, [`LoadError::NotFound`] lists each place and why it was not used.
//! With the library loaded, [`Verbs::devices`] lists the devices; none is
//! [`DeviceError::NoDevice`] — libibverbs returns `NULL` with `errno = ENOSYS` when the
//! kernel's verbs interface (`/sys/class/infiniband_verbs`) is absent, and an empty list when
//! no provider claims a device.
//!
//! One file each: `sys.rs` (the raw types and layouts), `search.rs` (the places, pure),
//! `error.rs` ([`LoadError`], [`DeviceError`], [`VerbsError`], [`VerbsOpError`]), `load.rs`
//! ([`Verbs`]), [`resources`] (owners of context, PD, MR, CQ, QP), [`select`] (device, port,
//! GID), [`qp_state`] (INIT/RTR/RTS attributes, pure), [`endpoint`] (connection records,
//! pure), [`flow`] (send-queue bookkeeping and shadow ADD, pure), [`sources`]
//! ([`SourceRegistry`]: source regions registered from other threads) and [`executor`]
//! ([`VerbsExecutor`]). Design and how to run it on a device: `docs/proxy-verbs.md`.

pub mod endpoint;
mod error;
pub mod executor;
pub mod flow;
mod load;
pub mod qp_state;
pub mod resources;
mod search;
pub mod select;
pub mod sources;
pub mod sys;

pub use endpoint::{EndpointError, QpEndpoint, RankEndpoints};
pub use error::{DeviceError, LoadError, Searched, VerbsError, VerbsOpError};
pub use executor::{HeapMemory, PreparedVerbs, VerbsConfig, VerbsExecutor};
pub use load::{DeviceInfo, Verbs};
pub use search::{Candidate, LibrarySearch, Origin};
pub use select::{DeviceSelector, GidSelector};
pub use sources::{SourceKey, SourceRegistry};

/// The soname looked for.
pub const LIBRARY_NAME: &str = "libibverbs.so.1";
/// Environment variable (step 1): the library file, or the directory holding it.
pub const ENV_EPCOMM_IBVERBS_LIB: &str = "EPCOMM_IBVERBS_LIB";
