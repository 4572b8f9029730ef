//! Executable specification of epcomm's cross-rank synchronization protocols.
//!
//! The intranode protocols of `docs/protocol.md` are modelled with one thread per rank and one
//! atomic per shared GPU word: the normal ops (dispatch, cached dispatch, combine) and the
//! low-latency ops ([`OpKind::LlDispatch`], [`OpKind::LlCombine`]: a send phase and a receive
//! phase each), in any mix; and, as a model only (no kernel yet), the hierarchical internode
//! dispatch ([`OpKind::InternodeDispatch`], [`OpKind::InternodeCachedDispatch`], steps `[I1]`..
//! `[I12]`; shape [`ModelConfig::with_nodes`]) and combine ([`OpKind::InternodeCombine`],
//! steps `[J1]`..`[J9]`), with their rail rows and partials either in per-op regions or
//! streamed through rings of chunks ([`ModelConfig::with_rail_ring`], steps `[I6c]`..`[I9c]`
//! and `[J6c]`..`[J9c]`). Under `RUSTFLAGS="--cfg loom"` the atomics and threads are loom's
//! and `tests/loom.rs` explores every interleaving within a preemption bound; in a normal build
//! the same code runs on std threads (`tests/stress.rs`, `tests/negative.rs`).
//!
//! Each step carries a stable label ([`Step`], e.g. `[E3]`) that the CUDA kernels cite.
//!
//! Properties checked on every run: (a) no count word with another epoch tag is used as
//! current ([`Violation::CountTag`]); (b) no data slot is overwritten before its owner consumed
//! it, nor read before it landed ([`Violation::Data`], including the `[R]` recheck of the live
//! dispatch output); (c) no deadlock (loom, or [`Violation::Timeout`] under std); (d) every op
//! that completes equals [`sequential_reference`]; (e) after an injected failure
//! ([`Failure`]) every rank's later ops end in an error, not a hang, and a failed rank writes
//! nothing more ([`check_outcome`], [`Violation::WriteAfterFailure`]); with internode ops, every
//! op that depends on the failed rank, directly or through forwarders and credits, ends in an
//! error naming it, and the others may complete ([`check_outcome_internode`]); (f) with rank
//! masking of the low-latency ops ([`ModelConfig::with_ll_masking`], the kernels'
//! `kFlagMasking`) and a rank that stops ([`StoppedRank`]: it publishes nothing more, no abort
//! word either), every survivor's waits for it expire once, mask it, and its later LL ops
//! complete equal to [`survivor_reference`] (no rows from the stopped rank, nothing for the
//! entries whose expert it holds); without masking, or in a normal op, the expiry fails the
//! op ([`OpError::Expired`]) and every later op ends in an error ([`check_outcome`]'s stop
//! rule).
//!
//! The model runs the kernels' two schedules ([`Schedule::Epoch`], [`Schedule::Global`]) with
//! the kernels' region rule (the parity of the op's sequence number, under both schedules).
//! [`Mutation`]s weaken one ordering, drop one wait or check, or (the deliberately unsound
//! [`Mutation::SingleRegion`] and [`Mutation::LlSingleRegion`]) the parity regions; the tests
//! show that the checker catches each of them.
//!
//! # Example
//!
//! Two ranks, three tokens each, one sender block, the Epoch schedule, on std threads:
//!
//! ```
//! use epcomm_protocol::{ModelConfig, NoHook, OpKind, Schedule, run_model, sequential_reference};
//!
//! let ops = vec![OpKind::Dispatch, OpKind::Combine, OpKind::CachedDispatch, OpKind::Combine];
//! let cfg = ModelConfig::new(2, 3, 1, Schedule::Epoch, ops)?;
//! let reports = run_model(&cfg, &NoHook).expect("no protocol violation");
//! assert_eq!(reports, sequential_reference(&cfg));
//! # Ok::<(), epcomm_protocol::ConfigError>(())
//! ```

pub mod config;
mod internode_outcome;
mod judge;
pub mod model;
pub mod outcome;
pub mod reference;
pub mod ring_entries;
mod sequential_outcome;
pub mod step;
mod stopped_outcome;
mod sync;

pub use config::{ConfigError, Failure, ModelConfig, Mutation, OpKind, RailRing, StoppedRank};
/// The schedules the model runs: the kernels' own type.
pub use epcomm_topology::Schedule;
pub use internode_outcome::{check_outcome_internode, failure_fires};
pub use judge::check_outcome;
#[cfg(not(loom))]
pub use model::{ModelFailure, run_model};
pub use model::{NoHook, OpError, Region, RunError, StepHook, Violation, World, run_rank};
pub use outcome::{OpOutput, OpResult, OutcomeViolation, RankReport};
pub use reference::{sequential_reference, sequential_reference_masked};
pub use step::Step;
pub use stopped_outcome::survivor_reference;
