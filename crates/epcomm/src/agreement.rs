//! Ranks agree on a `Buffer`'s configuration before anything moves.
//!
//! Every rank must build its `Buffer` with the same shapes, SM count, strategy, transport and
//! kernel build: the kernels count completion in blocks, size regions from the shapes and pick
//! parities by op counts, so a rank that differs would read another layout or finish an op
//! before every peer block published (silent wrong output). When a `Buffer` is built, every rank
//! all-gathers its [`Fingerprint`] over the host channel and checks it against every other
//! rank's; any difference fails the build on **every** rank with [`Error::ConfigMismatch`]
//! naming the field and each rank's value. The timeout is per rank and is not compared.

use crate::{Error, Result};

/// The fields that must agree, in a fixed order, as text (`field=value` lines).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    fields: Vec<(&'static str, String)>,
}

impl Fingerprint {
    /// Starts an empty fingerprint; add fields with [`Self::with`].
    pub(crate) fn new() -> Self {
        Self { fields: Vec::new() }
    }

    /// Adds one field.
    pub(crate) fn with(mut self, field: &'static str, value: impl std::fmt::Display) -> Self {
        self.fields.push((field, value.to_string()));
        self
    }

    /// Bytes for the all-gather.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = String::new();
        for (k, v) in &self.fields {
            out.push_str(k);
            out.push('=');
            out.push_str(v);
            out.push('\n');
        }
        out.into_bytes()
    }

    /// Checks this rank's fingerprint against every rank's (`all[r]` from rank `r`, this rank
    /// included). Every rank sees the same bytes, so every rank reaches the same verdict.
    pub(crate) fn agree(&self, all: &[Vec<u8>]) -> Result<()> {
        let decoded: Vec<Vec<(String, String)>> = all
            .iter()
            .map(|b| {
                String::from_utf8_lossy(b)
                    .lines()
                    .filter_map(|l| l.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            })
            .collect();
        for (i, (field, _)) in self.fields.iter().enumerate() {
            let values: Vec<Option<&str>> = decoded
                .iter()
                .map(|d| {
                    d.get(i)
                        .filter(|(k, _)| k == field)
                        .map(|(_, v)| v.as_str())
                })
                .collect();
            if values.windows(2).any(|w| w[0] != w[1]) {
                let values = values
                    .iter()
                    .enumerate()
                    .map(|(r, v)| format!("rank {r}: {}", v.unwrap_or("<not sent>")))
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(Error::ConfigMismatch { field, values });
            }
        }
        if let Some(r) = decoded.iter().position(|d| d.len() != self.fields.len()) {
            return Err(Error::ConfigMismatch {
                field: "fingerprint",
                values: format!(
                    "rank {r} sent {} fields, this build {} (different epcomm versions?)",
                    decoded[r].len(),
                    self.fields.len()
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(sms: u32, hidden: usize) -> Fingerprint {
        Fingerprint::new()
            .with("abi_version", 2)
            .with("num_sms", sms)
            .with("hidden", hidden)
    }

    #[test]
    fn equal_fingerprints_agree() {
        let all = vec![fp(24, 7168).encode(); 4];
        fp(24, 7168).agree(&all).unwrap();
    }

    #[test]
    fn a_difference_names_the_field_and_every_rank() {
        let all = vec![
            fp(24, 7168).encode(),
            fp(32, 7168).encode(),
            fp(24, 7168).encode(),
        ];
        let e = fp(24, 7168).agree(&all).unwrap_err();
        match &e {
            Error::ConfigMismatch { field, values } => {
                assert_eq!(*field, "num_sms");
                assert_eq!(values, "rank 0: 24, rank 1: 32, rank 2: 24");
            }
            other => panic!("{other:?}"),
        }
        // Every rank, whatever its own value, reaches the same verdict.
        let e2 = fp(32, 7168).agree(&all).unwrap_err();
        assert_eq!(e.to_string(), e2.to_string());
        // The first differing field is named.
        let all = vec![fp(24, 128).encode(), fp(24, 256).encode()];
        assert!(
            fp(24, 128)
                .agree(&all)
                .unwrap_err()
                .to_string()
                .contains("ranks disagree on hidden (rank 0: 128, rank 1: 256)")
        );
    }

    #[test]
    fn a_rank_of_another_version_is_refused() {
        let short = Fingerprint::new()
            .with("abi_version", 2)
            .with("num_sms", 24);
        let all = vec![fp(24, 7168).encode(), short.encode()];
        let e = fp(24, 7168).agree(&all).unwrap_err().to_string();
        assert!(e.contains("hidden") && e.contains("<not sent>"), "{e}");
    }
}
