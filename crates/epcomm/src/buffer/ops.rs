//! Op families (the inputs they share: `inputs`).
//!
//! * `layout`: routing statistics of `topk_idx` ([`crate::Layout`]);
//! * `normal`: dispatch, cached dispatch and combine through the symmetric buffer (the
//!   throughput kernels);
//! * `low_latency`: decode-sized dispatch/combine into fixed expert-major slots, each split
//!   into a send and a receive phase;
//! * `masking`: the low-latency ops' rank mask (read, set, cleared in stream order);
//! * `copy_out`: the rows a dispatch received, copied into caller memory as many as the device
//!   counted.
//!
//! Contract common to every op: it is **collective** (every rank issues the same ops in the same
//! order, each with the same number of blocks), **stream-ordered** on [`crate::Buffer::stream`]
//! (inputs must be ready on that stream, outputs are ready for work queued after it), checks
//! the buffer's health and every argument before it launches anything (a refused op changes no
//! state), and advances the host sequence mirror only once its kernel is launched.

mod copy_out;
mod layout;
mod low_latency;
mod masking;
mod normal;
mod staging;

pub use copy_out::{CountedRows, DeviceBytes, RecvArray};
pub(super) use low_latency::LowLatencyState;
pub use low_latency::{LlDispatchInput, LlFormat, LlPending, LlRecv, LlScalesLayout};
pub(super) use normal::LatestDispatch;

pub use super::inputs::{CombineInput, CombineOutput, DispatchInput, XInput};
