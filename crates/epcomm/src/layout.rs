//! Routing statistics computed on the GPU by the layout kernel.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr};

use crate::Result;
use crate::error::DriverContext;

/// Device arrays written by the layout kernel (owned; shared with the handles built on them).
#[derive(Debug)]
pub(crate) struct LayoutInner {
    /// `[world]` tokens per rank, `[E]` tokens per expert, `[nodes]` tokens per node (u32).
    pub(crate) counts: CudaSlice<u32>,
    /// `[T][world]` slot of each token among those sent to each rank, -1 if not sent.
    pub(crate) token_slot: CudaSlice<i32>,
    /// With rail forwarding: `[T][nodes]` index of each token among those for each node, -1
    /// if none.
    pub(crate) token_node_slot: Option<CudaSlice<i32>>,
    /// Nonzero when the kernel rejected a top-k id.
    pub(crate) status: CudaSlice<u32>,
    /// Tokens, or (with `device_tokens`) the most tokens the batch may have.
    pub(crate) num_tokens: usize,
    /// The batch's token count when only the device knows it (the layout kernel and every op
    /// along this layout read it there).
    pub(crate) device_tokens: Option<DeviceTokens>,
    pub(crate) world: usize,
    pub(crate) num_experts: usize,
    pub(crate) nodes: usize,
    pub(crate) buffer_id: u64,
    /// How many times the layout kernel was issued on this layout (0: never computed). A
    /// handle remembers the generation its dispatch routed with.
    pub(crate) generation: std::sync::atomic::AtomicU64,
}

/// A token count only the device knows: an `i32` that an earlier op on the same stream writes
/// (e.g. a dispatch's receive count), kept allocated by `owner`.
#[derive(Clone)]
pub(crate) struct DeviceTokens {
    /// Device address of the `i32`.
    pub(crate) ptr: u64,
    /// Keeps the allocation holding it alive.
    pub(crate) _owner: Arc<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for DeviceTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceTokens({:#x})", self.ptr)
    }
}

/// The routing of one batch: tokens per rank / expert / node and each token's slot in every
/// destination, on the device. Produced by [`crate::Buffer::layout`] and consumed by
/// [`crate::Buffer::dispatch`]; stream-ordered, so the host never waits for it.
#[derive(Clone, Debug)]
pub struct Layout {
    pub(crate) inner: Arc<LayoutInner>,
}

/// A host copy of a [`Layout`] (for tests and diagnostics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLayout {
    /// Tokens sent to each rank.
    pub tokens_per_rank: Vec<u32>,
    /// Top-k entries per expert.
    pub tokens_per_expert: Vec<u32>,
    /// Tokens sent to each node (a token counted once per node).
    pub tokens_per_node: Vec<u32>,
    /// `[T][world]` slot of each token in each rank, -1 where not sent.
    pub token_slot: Vec<i32>,
}

impl Layout {
    /// Tokens of the batch.
    pub fn num_tokens(&self) -> usize {
        self.inner.num_tokens
    }

    /// Device address of the `[world + num_experts + nodes]` u32 counts (tokens per rank, then
    /// per expert, then per node) the layout kernel writes on the buffer's stream: for bindings
    /// that copy them into arrays of their own, stream-ordered after the kernel.
    pub fn counts_ptr(&self) -> u64 {
        let counts = &self.inner.counts;
        counts.device_ptr(counts.stream()).0
    }

    /// Device address of the `[num_tokens][world]` i32 token slots (each token's slot among
    /// those sent to each rank, -1 where not sent), written like [`Self::counts_ptr`].
    pub fn token_slot_ptr(&self) -> u64 {
        let slots = &self.inner.token_slot;
        slots.device_ptr(slots.stream()).0
    }

    /// Copies the layout to the host (waits for the layout kernel).
    pub fn to_host(&self) -> Result<HostLayout> {
        let i = &self.inner;
        let stream = i.counts.stream().clone();
        let counts = stream
            .clone_dtoh(&i.counts)
            .context("reading layout counts")?;
        let mut token_slot = stream
            .clone_dtoh(&i.token_slot)
            .context("reading token slots")?;
        token_slot.truncate(i.num_tokens * i.world);
        Ok(HostLayout {
            tokens_per_rank: counts[..i.world].to_vec(),
            tokens_per_expert: counts[i.world..i.world + i.num_experts].to_vec(),
            tokens_per_node: counts[i.world + i.num_experts..i.world + i.num_experts + i.nodes]
                .to_vec(),
            token_slot,
        })
    }
}
