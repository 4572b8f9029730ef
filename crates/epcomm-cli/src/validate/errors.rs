//! The errors of `epcomm bench`'s (and `epcomm topo`'s) flags: one broken rule per
//! [`FlagError`], all of a run's in [`FlagErrors`].
//!
//! Contract: every error names the flag as the user typed it (`--tokens`, not
//! `max_tokens_per_rank`), and its `Display` is the one line the CLI prints for it.

use std::fmt;

use epcomm_topology::TopologyError;

/// One broken rule, naming the flag as typed on the command line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    /// Below the smallest allowed value.
    #[error("{flag} {value}: must be at least {min}")]
    TooSmall {
        /// The flag, e.g. `--iters`.
        flag: &'static str,
        /// The value given.
        value: u64,
        /// Smallest allowed value.
        min: u64,
    },
    /// Above the largest allowed value.
    #[error("{flag} {value}: must be at most {max} ({why})")]
    TooLarge {
        /// The flag.
        flag: &'static str,
        /// The value given (or the default in effect).
        value: u64,
        /// Largest allowed value.
        max: u64,
        /// Why.
        why: String,
    },
    /// Not a multiple of what it must be a multiple of.
    #[error("{flag} {value}: must be a multiple of {divisor} ({why})")]
    NotMultiple {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: u64,
        /// The divisor.
        divisor: u64,
        /// Why.
        why: String,
    },
    /// A value this combination of flags cannot use.
    #[error("{flag} {value}: {why}")]
    Unsupported {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: String,
        /// Why, and what to use instead.
        why: String,
    },
    /// `--hierarchical` on a transport and world that form one logical node.
    #[error("{}", single_node_message(.transport, *.world))]
    SingleNode {
        /// The transport spec, as the library prints it.
        transport: String,
        /// Ranks of the launch.
        world: usize,
    },
    /// Anything else about one flag.
    #[error("{flag}: {why}")]
    Invalid {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        why: String,
    },
}

impl FlagError {
    /// The flag the error is about, as typed (`--tokens`).
    pub fn flag(&self) -> &'static str {
        match self {
            Self::TooSmall { flag, .. }
            | Self::TooLarge { flag, .. }
            | Self::NotMultiple { flag, .. }
            | Self::Unsupported { flag, .. }
            | Self::Invalid { flag, .. } => flag,
            Self::SingleNode { .. } => "--hierarchical",
        }
    }

    /// `value < min`: the error, else `None`.
    pub fn at_least(flag: &'static str, value: u64, min: u64) -> Option<Self> {
        (value < min).then_some(Self::TooSmall { flag, value, min })
    }

    /// `value > max`: the error (with why), else `None`.
    pub fn at_most(
        flag: &'static str,
        value: u64,
        max: u64,
        why: impl Into<String>,
    ) -> Option<Self> {
        (value > max).then(|| Self::TooLarge {
            flag,
            value,
            max,
            why: why.into(),
        })
    }

    /// `value` not a multiple of `divisor` (> 0): the error, else `None`.
    pub fn multiple_of(
        flag: &'static str,
        value: u64,
        divisor: u64,
        why: impl Into<String>,
    ) -> Option<Self> {
        (!value.is_multiple_of(divisor)).then(|| Self::NotMultiple {
            flag,
            value,
            divisor,
            why: why.into(),
        })
    }

    /// A library rule broken by an argument, as the error of that argument's flag: `flags`
    /// maps the library's argument names to flags (the first one stands in for an argument it
    /// does not list).
    pub fn from_topology(e: &TopologyError, flags: &[(&str, &'static str)]) -> Self {
        let flag_of = |arg: &str| flags.iter().find(|(a, _)| *a == arg).map(|(_, f)| *f);
        let named = |arg: &'static str| flag_of(arg).unwrap_or(arg);
        let flag = topology_arg(e)
            .and_then(flag_of)
            .or_else(|| flags.first().map(|(_, f)| *f))
            .unwrap_or("--");
        match *e {
            TopologyError::Zero { .. } => Self::TooSmall {
                flag,
                value: 0,
                min: 1,
            },
            TopologyError::NotMultiple {
                value,
                divisor_arg,
                divisor,
                ..
            } => Self::NotMultiple {
                flag,
                value,
                divisor,
                // `8 (bf16 16-byte vectors)` -> `bf16 16-byte vectors`; an argument by its flag.
                why: divisor_arg
                    .strip_prefix(&divisor.to_string())
                    .map(|r| r.trim().trim_start_matches('(').trim_end_matches(')'))
                    .filter(|r| !r.is_empty())
                    .map_or_else(|| named(divisor_arg).to_string(), str::to_string),
            },
            TopologyError::IndexOutOfRange {
                value,
                bound_name,
                bound,
                ..
            } => Self::TooLarge {
                flag,
                value,
                max: bound.saturating_sub(1),
                why: format!("< {} {bound}", named(bound_name)),
            },
            TopologyError::OutOfRange {
                value,
                min,
                max,
                rule,
                ..
            } => Self::at_least(flag, value, min)
                .or_else(|| Self::at_most(flag, value, max, rule))
                .unwrap_or_else(|| Self::Invalid {
                    flag,
                    why: e.to_string(),
                }),
            _ => Self::Invalid {
                flag,
                why: e.to_string(),
            },
        }
    }
}

/// [`FlagError::SingleNode`]'s text: what is wrong and how to get several logical nodes.
fn single_node_message(transport: &str, world: usize) -> String {
    let ranks = if world < 2 {
        format!(
            "--world {world} is one rank, and one rank is one node: give --world 2 or more (with \
             --hierarchical ranks may share GPUs) and "
        )
    } else {
        format!("--transport {transport} puts the {world} ranks of this host in one node: ")
    };
    format!(
        "--hierarchical: needs more than one logical node; {ranks}split the host into logical \
         nodes with a spec `<transport>:vnodes=N` (N >= 2 dividing --world; e.g. --transport \
         nvshmem:vnodes=2 or proxy-ce:vnodes=2, the rail between them carried by put/signal), \
         or run the ranks on several hosts (one node per host)"
    )
}

/// The argument a topology error is about.
fn topology_arg(e: &TopologyError) -> Option<&'static str> {
    match *e {
        TopologyError::Zero { arg }
        | TopologyError::NotMultiple { arg, .. }
        | TopologyError::IndexOutOfRange { arg, .. }
        | TopologyError::OutOfRange { arg, .. }
        | TopologyError::NotPositiveFinite { arg, .. } => Some(arg),
        _ => None,
    }
}

/// Pushes the first error of `checks` (each `None` when its rule holds); true when there was
/// none.
pub(super) fn first_error(
    errs: &mut Vec<FlagError>,
    checks: impl IntoIterator<Item = Option<FlagError>>,
) -> bool {
    match checks.into_iter().flatten().next() {
        Some(e) => {
            errs.push(e);
            false
        }
        None => true,
    }
}

/// Every broken rule found (at least one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlagErrors(pub Vec<FlagError>);

impl fmt::Display for FlagErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for FlagErrors {}

impl FlagErrors {
    /// The error about `flag`, if any.
    pub fn about(&self, flag: &str) -> Option<&FlagError> {
        self.0.iter().find(|e| e.flag() == flag)
    }
}

#[cfg(test)]
mod tests {
    use epcomm_topology::{RowDtype, RowFormat};

    use super::*;

    #[test]
    fn library_rules_are_named_by_their_flag() {
        let flags = &[("hidden", "--hidden")];
        let e = RowFormat::new(100, RowDtype::Bf16).unwrap_err();
        assert_eq!(
            FlagError::from_topology(&e, flags).to_string(),
            "--hidden 100: must be a multiple of 8 (bf16 16-byte vectors)"
        );
        let e = RowFormat::new(0, RowDtype::Bf16).unwrap_err();
        assert_eq!(
            FlagError::from_topology(&e, flags),
            FlagError::TooSmall {
                flag: "--hidden",
                value: 0,
                min: 1
            }
        );
    }

    #[test]
    fn every_error_is_one_line() {
        assert!(FlagError::at_least("--iters", 1, 1).is_none());
        assert!(FlagError::at_most("--iters", 3, 3, "calls").is_none());
        assert!(FlagError::multiple_of("--experts", 6, 3, "split").is_none());
        let errs = FlagErrors(vec![
            FlagError::at_least("--iters", 0, 1).unwrap(),
            FlagError::Invalid {
                flag: "--plot",
                why: "empty path".into(),
            },
        ]);
        assert_eq!(
            errs.to_string(),
            "--iters 0: must be at least 1\n--plot: empty path"
        );
        assert_eq!(errs.about("--plot").map(FlagError::flag), Some("--plot"));
        assert!(errs.about("--sms").is_none());
    }
}
