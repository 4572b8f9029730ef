//! The error type of the crate.

/// Invalid input to a reference function. Every variant names the offending argument
/// (and, where it applies, the rank, token and top-k slot) and the rule it broke.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RefError {
    /// An argument that must be positive was zero (or a slice that must be non-empty was
    /// empty).
    #[error("`{arg}` must be > 0")]
    Zero {
        /// The argument.
        arg: &'static str,
    },
    /// `arg` must be a multiple of `divisor_arg`.
    #[error("`{arg}` ({value}) must be a multiple of `{divisor_arg}` ({divisor})")]
    NotMultiple {
        /// The argument.
        arg: &'static str,
        /// Its value.
        value: usize,
        /// The divisor's name (an argument or a fixed rule).
        divisor_arg: &'static str,
        /// The divisor.
        divisor: usize,
    },
    /// A slice had the wrong length.
    #[error("`{arg}` has length {actual}, expected {expected} ({rule})")]
    Length {
        /// The argument.
        arg: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        actual: usize,
        /// How the expected length is derived.
        rule: &'static str,
    },
    /// A top-k entry was neither `-1` nor a valid expert.
    #[error("topk_idx[{token}][{k}] = {expert} must be -1 or in [0, {num_experts})")]
    ExpertOutOfRange {
        /// Token index.
        token: usize,
        /// Top-k slot.
        k: usize,
        /// The bad value.
        expert: i64,
        /// Number of experts.
        num_experts: usize,
    },
    /// A token names one expert twice (the low-latency layout gives each (token, expert) one
    /// row).
    #[error("topk_idx[{token}] names expert {expert} twice (k = {first} and k = {second})")]
    DuplicateExpert {
        /// Token index.
        token: usize,
        /// The expert.
        expert: i64,
        /// First slot naming it.
        first: usize,
        /// Second slot naming it.
        second: usize,
    },
    /// A value that must be equal on every rank differs from rank 0's.
    #[error("`{arg}` differs between ranks: rank 0 has {expected}, rank {rank} has {actual}")]
    Inconsistent {
        /// The argument.
        arg: &'static str,
        /// The rank that differs.
        rank: usize,
        /// Rank 0's value.
        expected: String,
        /// This rank's value.
        actual: String,
    },
    /// A value exceeded an upper bound.
    #[error("`{arg}` ({value}) must be <= {max}: {rule}")]
    TooLarge {
        /// The argument.
        arg: &'static str,
        /// Its value.
        value: u64,
        /// Inclusive maximum.
        max: u64,
        /// Why.
        rule: &'static str,
    },
    /// A probability or other real argument outside its range.
    #[error("`{arg}` ({value}) must be in [{min}, {max}]")]
    OutOfRange {
        /// The argument.
        arg: &'static str,
        /// Its value.
        value: f64,
        /// Inclusive minimum.
        min: f64,
        /// Inclusive maximum.
        max: f64,
    },
    /// A row of a dispatch output handed to combine is malformed.
    #[error("dispatch_outputs[{rank}] row {row}: {rule}")]
    BadRow {
        /// The receiving rank.
        rank: usize,
        /// The row.
        row: usize,
        /// What is wrong.
        rule: &'static str,
    },
    /// The tiers of a hierarchical function do not cover the world it was given.
    #[error(
        "tiers of {nodes} nodes x {local_ranks} local ranks do not cover the {world_size} ranks \
         given (nodes * local_ranks must equal the world size)"
    )]
    TiersMismatch {
        /// [`Tiers::nodes`](epcomm_topology::Tiers::nodes).
        nodes: usize,
        /// [`Tiers::local_ranks`](epcomm_topology::Tiers::local_ranks).
        local_ranks: usize,
        /// The number of ranks of the inputs.
        world_size: usize,
    },
    /// A row format the rows cannot have (FP8 rows need `hidden % 128 == 0`): the rule comes
    /// from [`epcomm_topology::RowFormat`], shared with the buffer plans and kernel arguments.
    #[error("row format: {0}")]
    Row(#[from] epcomm_topology::TopologyError),
    /// An error in the input of one rank.
    #[error("rank {rank}: {source}")]
    InRank {
        /// The rank whose input is bad.
        rank: usize,
        /// The error.
        #[source]
        source: Box<RefError>,
    },
}

impl RefError {
    pub(crate) fn in_rank(self, rank: usize) -> Self {
        RefError::InRank {
            rank,
            source: Box::new(self),
        }
    }

    /// [`RefError::Zero`] naming the first `(name, value)` whose value is 0.
    pub(crate) fn nonzero(args: &[(&'static str, usize)]) -> Result<(), Self> {
        match args.iter().find(|(_, value)| *value == 0) {
            Some(&(arg, _)) => Err(RefError::Zero { arg }),
            None => Ok(()),
        }
    }

    /// [`RefError::TooLarge`] unless `value <= max`.
    pub(crate) fn at_most(
        arg: &'static str,
        value: usize,
        max: usize,
        rule: &'static str,
    ) -> Result<(), Self> {
        if value > max {
            Err(RefError::TooLarge {
                arg,
                value: value as u64,
                max: max as u64,
                rule,
            })
        } else {
            Ok(())
        }
    }

    /// `a * b`, or [`RefError::TooLarge`] naming `arg` when it overflows `usize`.
    pub(crate) fn product(arg: &'static str, a: usize, b: usize) -> Result<usize, Self> {
        a.checked_mul(b).ok_or(RefError::TooLarge {
            arg,
            value: u64::MAX,
            max: usize::MAX as u64,
            rule: "must fit in usize",
        })
    }

    pub(crate) fn multiple_check(
        arg: &'static str,
        value: usize,
        divisor_arg: &'static str,
        divisor: usize,
    ) -> Result<(), Self> {
        if divisor == 0 || !value.is_multiple_of(divisor) {
            Err(RefError::NotMultiple {
                arg,
                value,
                divisor_arg,
                divisor,
            })
        } else {
            Ok(())
        }
    }

    pub(crate) fn len_check(
        arg: &'static str,
        actual: usize,
        expected: usize,
        rule: &'static str,
    ) -> Result<(), Self> {
        if actual != expected {
            Err(RefError::Length {
                arg,
                expected,
                actual,
                rule,
            })
        } else {
            Ok(())
        }
    }
}
