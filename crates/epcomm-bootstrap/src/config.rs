//! [`BootstrapConfig`]: who this process is and where the coordinator lives, usually read from
//! the launcher's environment variables.

use std::collections::HashMap;
use std::time::Duration;

use crate::error::{BootstrapError, Result};

/// Timeout used when `EPCOMM_BOOTSTRAP_TIMEOUT_MS` is not set: 300 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Environment variable that overrides [`DEFAULT_TIMEOUT`], in milliseconds.
pub const TIMEOUT_ENV: &str = "EPCOMM_BOOTSTRAP_TIMEOUT_MS";

/// The launcher whose variables a config is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Launcher {
    /// torchrun / `torch.distributed` style: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`.
    Torchrun,
    /// Slurm `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, ...
    Slurm,
    /// OpenMPI `mpirun`: `OMPI_COMM_WORLD_*`.
    OpenMpi,
}

impl Launcher {
    fn describe(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun-style launch detected because RANK is set",
            Launcher::Slurm => "Slurm launch detected because SLURM_PROCID is set",
            Launcher::OpenMpi => "OpenMPI launch detected because OMPI_COMM_WORLD_RANK is set",
        }
    }
}

/// Identity of this process in the group and the coordinator's address.
///
/// Invariants checked by [`BootstrapConfig::validate`] (and by [`crate::Bootstrap::connect`]):
/// `rank < world_size`, `local_rank < local_world_size <= world_size`, `timeout > 0`,
/// `master_addr` non-empty, `master_port != 0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapConfig {
    /// Host name or IP of rank 0, where the coordinator listens.
    pub master_addr: String,
    /// TCP port of the coordinator.
    pub master_port: u16,
    /// Global rank of this process, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the group.
    pub world_size: usize,
    /// Rank of this process on its node; it selects the GPU.
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Bound on connecting and on every collective.
    pub timeout: Duration,
}

impl BootstrapConfig {
    /// Reads the config from the process environment; see [`BootstrapConfig::from_lookup`].
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the config from a map of variables (for tests and embedding).
    pub fn from_map(vars: &HashMap<String, String>) -> Result<Self> {
        Self::from_lookup(|k| vars.get(k).cloned())
    }

    /// Reads the config through `lookup(name) -> value`.
    ///
    /// The launcher is detected by its rank variable, first match wins:
    /// * `RANK` → torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` are required.
    /// * `SLURM_PROCID` → Slurm: `SLURM_PROCID`, `SLURM_NTASKS` (or `SLURM_NPROCS`),
    ///   `SLURM_LOCALID` are required; the local world size is `SLURM_NTASKS_PER_NODE`, else
    ///   this node's entry of `SLURM_TASKS_PER_NODE` (e.g. `4(x2),3`, indexed by
    ///   `SLURM_NODEID`), else `SLURM_NTASKS / SLURM_NNODES` when it divides evenly.
    /// * `OMPI_COMM_WORLD_RANK` → OpenMPI: `OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}`.
    ///
    /// `MASTER_ADDR` and `MASTER_PORT` are always required. `EPCOMM_BOOTSTRAP_TIMEOUT_MS`
    /// (positive integer, milliseconds) is optional and defaults to [`DEFAULT_TIMEOUT`].
    /// The result is validated with [`BootstrapConfig::validate`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let env = Env { lookup: &lookup };
        let launcher = if env.get("RANK").is_some() {
            Launcher::Torchrun
        } else if env.get("SLURM_PROCID").is_some() {
            Launcher::Slurm
        } else if env.get("OMPI_COMM_WORLD_RANK").is_some() {
            Launcher::OpenMpi
        } else {
            return Err(BootstrapError::NoLauncherEnv);
        };
        let ctx = launcher.describe();
        let (rank, world_size, local_rank, local_world_size) = match launcher {
            Launcher::Torchrun => (
                env.usize("RANK", ctx)?,
                env.usize("WORLD_SIZE", ctx)?,
                env.usize("LOCAL_RANK", ctx)?,
                env.usize("LOCAL_WORLD_SIZE", ctx)?,
            ),
            Launcher::OpenMpi => (
                env.usize("OMPI_COMM_WORLD_RANK", ctx)?,
                env.usize("OMPI_COMM_WORLD_SIZE", ctx)?,
                env.usize("OMPI_COMM_WORLD_LOCAL_RANK", ctx)?,
                env.usize("OMPI_COMM_WORLD_LOCAL_SIZE", ctx)?,
            ),
            Launcher::Slurm => {
                let rank = env.usize("SLURM_PROCID", ctx)?;
                let world =
                    if env.get("SLURM_NTASKS").is_none() && env.get("SLURM_NPROCS").is_some() {
                        env.usize("SLURM_NPROCS", ctx)?
                    } else {
                        env.usize("SLURM_NTASKS", ctx)?
                    };
                let local_rank = env.usize("SLURM_LOCALID", ctx)?;
                let local_world = slurm_local_world_size(&env, world)?;
                (rank, world, local_rank, local_world)
            }
        };
        let master_addr =
            env.required("MASTER_ADDR", "the coordinator address is always required")?;
        let port_ctx = "the coordinator port is always required";
        let master_port = match env.required("MASTER_PORT", port_ctx)?.trim().parse::<u16>() {
            Ok(p) if p != 0 => p,
            _ => {
                return Err(BootstrapError::InvalidEnv {
                    var: "MASTER_PORT".into(),
                    value: env.get("MASTER_PORT").unwrap_or_default(),
                    rule: "must be a TCP port number in 1..=65535".into(),
                });
            }
        };
        let timeout = match env.get(TIMEOUT_ENV) {
            None => DEFAULT_TIMEOUT,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Duration::from_millis(ms),
                _ => {
                    return Err(BootstrapError::InvalidEnv {
                        var: TIMEOUT_ENV.into(),
                        value: v,
                        rule: "must be a positive integer number of milliseconds".into(),
                    });
                }
            },
        };
        let cfg = BootstrapConfig {
            master_addr: master_addr.trim().to_string(),
            master_port,
            rank,
            world_size,
            local_rank,
            local_world_size,
            timeout,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the invariants listed on the type; the error names the field and the rule.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, value: String, rule: String| {
            Err(BootstrapError::InvalidConfig { field, value, rule })
        };
        if self.master_addr.trim().is_empty() {
            return bad(
                "master_addr",
                format!("{:?}", self.master_addr),
                "must not be empty".into(),
            );
        }
        if self.master_port == 0 {
            return bad("master_port", "0".into(), "must be in 1..=65535".into());
        }
        if self.world_size == 0 {
            return bad("world_size", "0".into(), "must be at least 1".into());
        }
        if self.rank >= self.world_size {
            return bad(
                "rank",
                self.rank.to_string(),
                format!("must be below world_size {}", self.world_size),
            );
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return bad(
                "local_world_size",
                self.local_world_size.to_string(),
                format!("must be in 1..={} (world_size)", self.world_size),
            );
        }
        if self.local_rank >= self.local_world_size {
            return bad(
                "local_rank",
                self.local_rank.to_string(),
                format!("must be below local_world_size {}", self.local_world_size),
            );
        }
        if self.timeout.is_zero() {
            return bad("timeout", "0s".into(), "must be positive".into());
        }
        Ok(())
    }
}

struct Env<'a> {
    lookup: &'a dyn Fn(&str) -> Option<String>,
}

impl Env<'_> {
    /// The value of `var`, treating an empty or all-blank value as unset.
    fn get(&self, var: &str) -> Option<String> {
        (self.lookup)(var).filter(|v| !v.trim().is_empty())
    }

    fn required(&self, var: &str, context: &str) -> Result<String> {
        self.get(var).ok_or_else(|| BootstrapError::MissingEnv {
            var: var.to_string(),
            context: context.to_string(),
        })
    }

    fn usize(&self, var: &str, context: &str) -> Result<usize> {
        let v = self.required(var, context)?;
        v.trim()
            .parse::<usize>()
            .map_err(|_| BootstrapError::InvalidEnv {
                var: var.to_string(),
                value: v.clone(),
                rule: "must be a non-negative integer".into(),
            })
    }
}

fn slurm_local_world_size(env: &Env<'_>, world: usize) -> Result<usize> {
    let ctx = Launcher::Slurm.describe();
    if env.get("SLURM_NTASKS_PER_NODE").is_some() {
        return env.usize("SLURM_NTASKS_PER_NODE", ctx);
    }
    if let Some(spec) = env.get("SLURM_TASKS_PER_NODE") {
        let node = if env.get("SLURM_NODEID").is_some() {
            env.usize("SLURM_NODEID", ctx)?
        } else {
            0
        };
        let counts =
            parse_slurm_tasks_per_node(&spec).ok_or_else(|| BootstrapError::InvalidEnv {
                var: "SLURM_TASKS_PER_NODE".into(),
                value: spec.clone(),
                rule: "must be a comma-separated list of N or N(xM) entries".into(),
            })?;
        return counts
            .get(node)
            .copied()
            .ok_or_else(|| BootstrapError::InvalidEnv {
                var: "SLURM_NODEID".into(),
                value: node.to_string(),
                rule: format!(
                    "must index SLURM_TASKS_PER_NODE={spec:?} ({} nodes)",
                    counts.len()
                ),
            });
    }
    if env.get("SLURM_NNODES").is_some() {
        let nodes = env.usize("SLURM_NNODES", ctx)?;
        if nodes > 0 && world.is_multiple_of(nodes) {
            return Ok(world / nodes);
        }
        return Err(BootstrapError::InvalidEnv {
            var: "SLURM_NNODES".into(),
            value: nodes.to_string(),
            rule: format!(
                "must divide SLURM_NTASKS={world} to derive the local world size; set \
                 SLURM_NTASKS_PER_NODE instead"
            ),
        });
    }
    Err(BootstrapError::MissingEnv {
        var: "SLURM_NTASKS_PER_NODE".into(),
        context: format!(
            "{ctx}; the local world size is also derivable from SLURM_TASKS_PER_NODE or \
             SLURM_NNODES, and neither is set"
        ),
    })
}

/// Expands Slurm's compressed task list (`"4(x2),3"` → `[4, 4, 3]`).
fn parse_slurm_tasks_per_node(spec: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in spec.split(',') {
        let part = part.trim();
        let (count, repeat) = match part.split_once('(') {
            Some((count, rest)) => {
                let rep = rest.strip_prefix('x')?.strip_suffix(')')?;
                (count, rep.parse::<usize>().ok()?)
            }
            None => (part, 1),
        };
        let count = count.parse::<usize>().ok()?;
        if repeat > 1 << 20 {
            return None;
        }
        out.extend(std::iter::repeat_n(count, repeat));
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const MASTER: [(&str, &str); 2] = [("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")];

    fn with_master(pairs: &[(&'static str, &'static str)]) -> HashMap<String, String> {
        let mut all = pairs.to_vec();
        all.extend_from_slice(&MASTER);
        map(&all)
    }

    #[test]
    fn torchrun_variables() {
        let cfg = BootstrapConfig::from_map(&with_master(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
        ]))
        .unwrap();
        assert_eq!(
            cfg,
            BootstrapConfig {
                master_addr: "node0".into(),
                master_port: 29500,
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                timeout: DEFAULT_TIMEOUT,
            }
        );
    }

    #[test]
    fn torchrun_takes_precedence_over_slurm() {
        let cfg = BootstrapConfig::from_map(&with_master(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ]))
        .unwrap();
        assert_eq!((cfg.rank, cfg.world_size), (1, 2));
    }

    #[test]
    fn missing_torchrun_variable_is_named() {
        let err = BootstrapConfig::from_map(&with_master(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
        ]))
        .unwrap_err();
        match err {
            BootstrapError::MissingEnv { var, context } => {
                assert_eq!(var, "LOCAL_WORLD_SIZE");
                assert!(context.contains("torchrun"), "{context}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn slurm_variables_with_explicit_tasks_per_node() {
        let cfg = BootstrapConfig::from_map(&with_master(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "8"),
        ]))
        .unwrap();
        assert_eq!(
            (
                cfg.rank,
                cfg.world_size,
                cfg.local_rank,
                cfg.local_world_size
            ),
            (6, 16, 2, 8)
        );
    }

    #[test]
    fn slurm_local_size_from_compressed_list_and_node_id() {
        let cfg = BootstrapConfig::from_map(&with_master(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "11"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2),3"),
            ("SLURM_NODEID", "2"),
        ]))
        .unwrap();
        assert_eq!(cfg.local_world_size, 3);
    }

    #[test]
    fn slurm_local_size_from_node_count() {
        let cfg = BootstrapConfig::from_map(&with_master(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "3"),
            ("SLURM_NNODES", "2"),
        ]))
        .unwrap();
        assert_eq!(cfg.local_world_size, 4);
        let err = BootstrapConfig::from_map(&with_master(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "3"),
            ("SLURM_NNODES", "2"),
        ]))
        .unwrap_err();
        assert!(matches!(err, BootstrapError::InvalidEnv { ref var, .. } if var == "SLURM_NNODES"));
    }

    #[test]
    fn slurm_without_local_size_names_the_variable() {
        let err = BootstrapConfig::from_map(&with_master(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
        ]))
        .unwrap_err();
        assert!(
            matches!(err, BootstrapError::MissingEnv { ref var, .. } if var == "SLURM_NTASKS_PER_NODE"),
            "{err:?}"
        );
    }

    #[test]
    fn openmpi_variables() {
        let cfg = BootstrapConfig::from_map(&with_master(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            (TIMEOUT_ENV, "2500"),
        ]))
        .unwrap();
        assert_eq!(
            (
                cfg.rank,
                cfg.world_size,
                cfg.local_rank,
                cfg.local_world_size
            ),
            (3, 4, 1, 2)
        );
        assert_eq!(cfg.timeout, Duration::from_millis(2500));
    }

    #[test]
    fn no_launcher_is_reported() {
        let err = BootstrapConfig::from_map(&map(&MASTER)).unwrap_err();
        assert!(matches!(err, BootstrapError::NoLauncherEnv));
        assert!(err.to_string().contains("SLURM_PROCID"));
    }

    #[test]
    fn invalid_values_are_named() {
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
        ];
        let cases: [(&str, &str, &str); 5] = [
            ("RANK", "-1", "RANK"),
            ("WORLD_SIZE", "two", "WORLD_SIZE"),
            ("MASTER_PORT", "70000", "MASTER_PORT"),
            ("MASTER_PORT", "0", "MASTER_PORT"),
            (TIMEOUT_ENV, "0", TIMEOUT_ENV),
        ];
        for (k, v, expected) in cases {
            let mut vars = with_master(&base);
            vars.insert(k.into(), v.into());
            match BootstrapConfig::from_map(&vars).unwrap_err() {
                BootstrapError::InvalidEnv { var, value, .. } => {
                    assert_eq!(var, expected);
                    assert_eq!(value, v);
                }
                other => panic!("{k}={v}: unexpected {other:?}"),
            }
        }
        let mut vars = map(&base);
        vars.insert("MASTER_PORT".into(), "1".into());
        assert!(matches!(
            BootstrapConfig::from_map(&vars).unwrap_err(),
            BootstrapError::MissingEnv { ref var, .. } if var == "MASTER_ADDR"
        ));
    }

    #[test]
    fn inconsistent_values_fail_validation() {
        let cases: [(&str, &str, &str); 3] = [
            ("RANK", "2", "rank"),
            ("LOCAL_RANK", "2", "local_rank"),
            ("LOCAL_WORLD_SIZE", "3", "local_world_size"),
        ];
        for (k, v, field_name) in cases {
            let mut vars = with_master(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "0"),
                ("LOCAL_WORLD_SIZE", "2"),
            ]);
            vars.insert(k.into(), v.into());
            match BootstrapConfig::from_map(&vars).unwrap_err() {
                BootstrapError::InvalidConfig { field, .. } => assert_eq!(field, field_name),
                other => panic!("{k}={v}: unexpected {other:?}"),
            }
        }
    }

    #[test]
    fn slurm_task_list_parser() {
        assert_eq!(parse_slurm_tasks_per_node("8"), Some(vec![8]));
        assert_eq!(
            parse_slurm_tasks_per_node("2(x3),1"),
            Some(vec![2, 2, 2, 1])
        );
        assert_eq!(parse_slurm_tasks_per_node("2(3)"), None);
        assert_eq!(parse_slurm_tasks_per_node("a"), None);
        assert_eq!(parse_slurm_tasks_per_node(""), None);
    }
}
