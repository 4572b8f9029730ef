//! The error type of the crate.

/// An invalid argument (or an arithmetic overflow caused by one) in a topology computation.
///
/// Every variant names the argument (`arg`) and the rule it broke, so callers can surface the
/// message unchanged.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TopologyError {
    /// An argument that must be positive was zero.
    #[error("`{arg}` must be > 0")]
    Zero {
        /// The argument's name.
        arg: &'static str,
    },
    /// `arg` must be a multiple of `divisor_arg`.
    #[error("`{arg}` ({value}) must be a multiple of `{divisor_arg}` ({divisor})")]
    NotMultiple {
        /// The argument's name.
        arg: &'static str,
        /// Its value.
        value: u64,
        /// The name of the divisor (an argument or a fixed rule such as `8`).
        divisor_arg: &'static str,
        /// The divisor's value.
        divisor: u64,
    },
    /// An index argument was not below its bound.
    #[error("`{arg}` ({value}) must be < {bound_name} ({bound})")]
    IndexOutOfRange {
        /// The argument's name.
        arg: &'static str,
        /// Its value.
        value: u64,
        /// What bounds it (`world_size`, `num_experts`, ...).
        bound_name: &'static str,
        /// The exclusive bound.
        bound: u64,
    },
    /// A value was outside an inclusive range.
    #[error("`{arg}` ({value}) must be in [{min}, {max}]: {rule}")]
    OutOfRange {
        /// The argument's name.
        arg: &'static str,
        /// Its value.
        value: u64,
        /// Inclusive minimum.
        min: u64,
        /// Inclusive maximum.
        max: u64,
        /// Why the bounds are what they are.
        rule: &'static str,
    },
    /// A floating-point argument was not finite and positive.
    #[error("`{arg}` ({value}) must be finite and > 0")]
    NotPositiveFinite {
        /// The argument's name.
        arg: &'static str,
        /// Its value.
        value: f64,
    },
    /// A name (schedule, route, ...) that is not one of the valid ones.
    #[error("unknown {what} {got:?}: must be one of {}", valid.join(", "))]
    UnknownName {
        /// What was being named.
        what: &'static str,
        /// The name given.
        got: String,
        /// The valid names.
        valid: Vec<&'static str>,
    },
    /// The route a peer needs is not one the backend supports.
    #[error(
        "rank {peer} ({tier}) needs the {route} route, which this transport does not support \
         (it supports: {})",
        supported.join(", ")
    )]
    Unreachable {
        /// The peer.
        peer: usize,
        /// Where it sits (a `Tier` name).
        tier: &'static str,
        /// The route it needs.
        route: &'static str,
        /// The routes the backend supports.
        supported: Vec<&'static str>,
    },
    /// A size computation overflowed `u64`/`usize`.
    #[error("size of {what} overflows (arguments too large)")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// A size exceeded the limit the caller gave.
    #[error("{what} needs {value} bytes, more than the limit of {limit}: {rule}")]
    OverLimit {
        /// What was being sized.
        what: &'static str,
        /// Its size in bytes.
        value: u64,
        /// The inclusive limit.
        limit: u64,
        /// How the size is derived.
        rule: &'static str,
    },
}

impl TopologyError {
    pub(crate) fn zero_check(arg: &'static str, value: usize) -> Result<(), Self> {
        if value == 0 {
            Err(Self::Zero { arg })
        } else {
            Ok(())
        }
    }

    pub(crate) fn multiple_check(
        arg: &'static str,
        value: usize,
        divisor_arg: &'static str,
        divisor: usize,
    ) -> Result<(), Self> {
        if divisor == 0 || !value.is_multiple_of(divisor) {
            Err(Self::NotMultiple {
                arg,
                value: value as u64,
                divisor_arg,
                divisor: divisor as u64,
            })
        } else {
            Ok(())
        }
    }

    pub(crate) fn index_check(
        arg: &'static str,
        value: usize,
        bound_name: &'static str,
        bound: usize,
    ) -> Result<(), Self> {
        if value >= bound {
            Err(Self::IndexOutOfRange {
                arg,
                value: value as u64,
                bound_name,
                bound: bound as u64,
            })
        } else {
            Ok(())
        }
    }
}
