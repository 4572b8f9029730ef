//! [`BootstrapConfig`]: who this process is and where the coordinator lives, usually read from
//! the launcher's environment variables.

use std::collections::HashMap;
use std::io;
use std::net::TcpStream;
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};

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
    /// Every rank on this machine: the coordinator at `127.0.0.1:master_port`, `local_rank ==
    /// rank` and `local_world_size == world_size` (what one process or thread per local GPU,
    /// without a launcher, needs). Not validated: [`crate::Bootstrap::connect`] checks it.
    pub fn single_host(
        master_port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Self {
        Self {
            master_addr: "127.0.0.1".into(),
            master_port,
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            timeout,
        }
    }

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

/// How a rank and the coordinator notice a peer that is gone without closing its connection:
/// a host that vanished (power loss, network partition) or a process that is alive but frozen
/// (`SIGSTOP`, a debugger, a hung machine).
///
/// Two mechanisms, both on by default:
///
/// * **Heartbeats** (application level). Every rank sends a small `Heartbeat` frame every
///   `heartbeat_interval` from a background thread, whether or not it is inside a collective;
///   while a rank waits for the coordinator (in [`crate::Bootstrap::connect`] or a collective),
///   the coordinator sends it heartbeats at the same interval. Any bytes received count as a
///   sign of life. When the coordinator has received nothing from a rank for `peer_timeout`,
///   it declares the rank dead: every pending and later collective fails on every other rank
///   with [`crate::BootstrapError::PeerUnresponsive`] naming it. When a waiting rank has
///   received nothing from the coordinator for `peer_timeout`, its call fails with
///   `PeerUnresponsive { rank: 0, .. }`. A rank that is merely busy (not calling collectives)
///   keeps sending heartbeats, so it is not affected: its peers wait for it up to
///   [`BootstrapConfig::timeout`] as before. Each rank announces its own interval and limit in
///   its handshake, and the coordinator applies that rank's values to its connection, so ranks
///   started with different settings do not misjudge each other. A peer that accepts no bytes
///   for `peer_timeout` while being written to counts as silent too (the socket write timeout
///   is shortened to it).
/// * **TCP keepalive** on every bootstrap socket (both ends), probing an idle connection after
///   `keepalive_idle`, every `keepalive_interval`, giving up after `keepalive_probes`
///   unanswered probes. It needs no cooperation from the peer process, so it also covers
///   `peer_timeout = 0`, but it cannot see a frozen process (its kernel still answers probes).
///   Durations are rounded up to whole seconds (the granularity of the socket options).
///
/// [`crate::Bootstrap::connect`] reads these settings with [`Liveness::from_env`], which starts
/// from [`Liveness::default`] and applies the `EPCOMM_BOOTSTRAP_*` overrides listed on
/// [`Liveness::from_lookup`]; [`crate::Bootstrap::connect_with_liveness`] takes them explicitly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// How often heartbeats are sent (default 1 s). Must be positive and at most half of
    /// `peer_timeout` when `peer_timeout` is non-zero.
    pub heartbeat_interval: Duration,
    /// Silence after which a peer is declared dead (default 5 s). Zero disables heartbeats and
    /// silence detection; a frozen peer is then only caught by the operation timeout.
    pub peer_timeout: Duration,
    /// Idle time before the first TCP keepalive probe (default 2 s); zero disables keepalive.
    pub keepalive_idle: Duration,
    /// Time between unanswered keepalive probes (default 1 s).
    pub keepalive_interval: Duration,
    /// Unanswered probes after which the kernel drops the connection (default 3).
    pub keepalive_probes: u32,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            heartbeat_interval: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(5),
            keepalive_idle: Duration::from_secs(2),
            keepalive_interval: Duration::from_secs(1),
            keepalive_probes: 3,
        }
    }
}

/// Largest keepalive time or interval accepted, in seconds (Linux's limit).
const MAX_KEEPALIVE_SECS: u64 = 32767;
/// Largest keepalive probe count accepted (Linux's limit).
const MAX_KEEPALIVE_PROBES: u32 = 127;

impl Liveness {
    /// Overrides [`Liveness::heartbeat_interval`], in milliseconds (positive).
    pub const HEARTBEAT_ENV: &'static str = "EPCOMM_BOOTSTRAP_HEARTBEAT_MS";
    /// Overrides [`Liveness::peer_timeout`], in milliseconds (`0` disables).
    pub const PEER_TIMEOUT_ENV: &'static str = "EPCOMM_BOOTSTRAP_PEER_TIMEOUT_MS";
    /// Overrides [`Liveness::keepalive_idle`], in milliseconds (`0` disables keepalive).
    pub const KEEPALIVE_IDLE_ENV: &'static str = "EPCOMM_BOOTSTRAP_KEEPALIVE_IDLE_MS";
    /// Overrides [`Liveness::keepalive_interval`], in milliseconds (positive).
    pub const KEEPALIVE_INTERVAL_ENV: &'static str = "EPCOMM_BOOTSTRAP_KEEPALIVE_INTERVAL_MS";
    /// Overrides [`Liveness::keepalive_probes`] (positive).
    pub const KEEPALIVE_PROBES_ENV: &'static str = "EPCOMM_BOOTSTRAP_KEEPALIVE_PROBES";

    /// Reads the settings from the process environment; see [`Liveness::from_lookup`].
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`Liveness::default`] with the overrides found through `lookup(name) -> value`:
    /// [`Liveness::HEARTBEAT_ENV`], [`Liveness::PEER_TIMEOUT_ENV`],
    /// [`Liveness::KEEPALIVE_IDLE_ENV`], [`Liveness::KEEPALIVE_INTERVAL_ENV`] and
    /// [`Liveness::KEEPALIVE_PROBES_ENV`]. Empty values count as unset. The result is
    /// validated with [`Liveness::validate`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let env = Env { lookup: &lookup };
        let mut l = Liveness::default();
        let ms = |var: &str, allow_zero: bool| -> Result<Option<u64>> {
            let Some(v) = env.get(var) else {
                return Ok(None);
            };
            match v.trim().parse::<u64>() {
                Ok(n) if allow_zero || n > 0 => Ok(Some(n)),
                _ => Err(BootstrapError::InvalidEnv {
                    var: var.to_string(),
                    value: v,
                    rule: if allow_zero {
                        "must be a non-negative integer (0 disables)".into()
                    } else {
                        "must be a positive integer".into()
                    },
                }),
            }
        };
        if let Some(n) = ms(Self::HEARTBEAT_ENV, false)? {
            l.heartbeat_interval = Duration::from_millis(n);
        }
        if let Some(n) = ms(Self::PEER_TIMEOUT_ENV, true)? {
            l.peer_timeout = Duration::from_millis(n);
        }
        if let Some(n) = ms(Self::KEEPALIVE_IDLE_ENV, true)? {
            l.keepalive_idle = Duration::from_millis(n);
        }
        if let Some(n) = ms(Self::KEEPALIVE_INTERVAL_ENV, false)? {
            l.keepalive_interval = Duration::from_millis(n);
        }
        if let Some(n) = ms(Self::KEEPALIVE_PROBES_ENV, false)? {
            l.keepalive_probes = u32::try_from(n).unwrap_or(u32::MAX);
        }
        l.validate()?;
        Ok(l)
    }

    /// Heartbeats and silence detection disabled (`peer_timeout` zero), keepalive unchanged.
    pub fn without_heartbeats(self) -> Self {
        Liveness {
            peer_timeout: Duration::ZERO,
            ..self
        }
    }

    /// Enables TCP keepalive on `stream` with these settings (no-op when `keepalive_idle` is
    /// zero). Durations are rounded up to whole seconds.
    pub(crate) fn apply_keepalive(&self, stream: &TcpStream) -> io::Result<()> {
        if self.keepalive_idle.is_zero() {
            return Ok(());
        }
        let whole_secs =
            |d: Duration| Duration::from_secs(d.as_secs() + u64::from(d.subsec_nanos() > 0));
        let ka = TcpKeepalive::new().with_time(whole_secs(self.keepalive_idle));
        #[cfg(any(
            target_os = "linux",
            target_os = "android",
            target_os = "macos",
            target_os = "freebsd",
            target_os = "netbsd",
            target_os = "windows"
        ))]
        let ka = ka
            .with_interval(whole_secs(self.keepalive_interval))
            .with_retries(self.keepalive_probes);
        SockRef::from(stream).set_tcp_keepalive(&ka)
    }

    /// Checks the rules listed on the fields; the error names the field and the rule.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, value: String, rule: String| {
            Err(BootstrapError::InvalidConfig { field, value, rule })
        };
        if !self.peer_timeout.is_zero() {
            if self.heartbeat_interval.is_zero() {
                return bad(
                    "liveness.heartbeat_interval",
                    "0s".into(),
                    "must be positive while peer_timeout is non-zero".into(),
                );
            }
            if self.heartbeat_interval > self.peer_timeout / 2 {
                return bad(
                    "liveness.heartbeat_interval",
                    format!("{:?}", self.heartbeat_interval),
                    format!(
                        "must be at most half of peer_timeout ({:?}), so that one late \
                         heartbeat is not taken for a dead peer",
                        self.peer_timeout
                    ),
                );
            }
        }
        if !self.keepalive_idle.is_zero() {
            for (field, d) in [
                ("liveness.keepalive_idle", self.keepalive_idle),
                ("liveness.keepalive_interval", self.keepalive_interval),
            ] {
                if d.is_zero() || d > Duration::from_secs(MAX_KEEPALIVE_SECS) {
                    return bad(
                        field,
                        format!("{d:?}"),
                        format!("must be in (0, {MAX_KEEPALIVE_SECS}s]"),
                    );
                }
            }
            if self.keepalive_probes == 0 || self.keepalive_probes > MAX_KEEPALIVE_PROBES {
                return bad(
                    "liveness.keepalive_probes",
                    self.keepalive_probes.to_string(),
                    format!("must be in 1..={MAX_KEEPALIVE_PROBES}"),
                );
            }
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

    /// The config `pairs` (plus a master) give, and its (rank, world, local rank, local world).
    fn ranks_of(
        pairs: &[(&'static str, &'static str)],
    ) -> (BootstrapConfig, (usize, usize, usize, usize)) {
        let cfg = BootstrapConfig::from_map(&with_master(pairs)).unwrap();
        let ranks = (
            cfg.rank,
            cfg.world_size,
            cfg.local_rank,
            cfg.local_world_size,
        );
        (cfg, ranks)
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
        let (_, ranks) = ranks_of(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "8"),
        ]);
        assert_eq!(ranks, (6, 16, 2, 8));
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
        let (cfg, ranks) = ranks_of(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            (TIMEOUT_ENV, "2500"),
        ]);
        assert_eq!(ranks, (3, 4, 1, 2));
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
    fn liveness_defaults_and_overrides() {
        let l = Liveness::from_map_for_test(&[]).unwrap();
        assert_eq!(l, Liveness::default());
        assert_eq!(l.heartbeat_interval, Duration::from_secs(1));
        assert_eq!(l.peer_timeout, Duration::from_secs(5));
        assert_eq!(
            (l.keepalive_idle, l.keepalive_interval, l.keepalive_probes),
            (Duration::from_secs(2), Duration::from_secs(1), 3)
        );
        let l = Liveness::from_map_for_test(&[
            (Liveness::HEARTBEAT_ENV, "250"),
            (Liveness::PEER_TIMEOUT_ENV, "1500"),
            (Liveness::KEEPALIVE_IDLE_ENV, "0"),
            (Liveness::KEEPALIVE_INTERVAL_ENV, "3000"),
            (Liveness::KEEPALIVE_PROBES_ENV, "9"),
        ])
        .unwrap();
        assert_eq!(
            l,
            Liveness {
                heartbeat_interval: Duration::from_millis(250),
                peer_timeout: Duration::from_millis(1500),
                keepalive_idle: Duration::ZERO,
                keepalive_interval: Duration::from_secs(3),
                keepalive_probes: 9,
            }
        );
        // Zero disables silence detection; the heartbeat interval is then irrelevant.
        let l = Liveness::from_map_for_test(&[(Liveness::PEER_TIMEOUT_ENV, "0")]).unwrap();
        assert!(l.peer_timeout.is_zero());
        assert_eq!(l, Liveness::default().without_heartbeats());
    }

    #[test]
    fn invalid_liveness_values_are_named() {
        for (var, value) in [
            (Liveness::HEARTBEAT_ENV, "0"),
            (Liveness::HEARTBEAT_ENV, "1s"),
            (Liveness::PEER_TIMEOUT_ENV, "-5"),
            (Liveness::KEEPALIVE_INTERVAL_ENV, "0"),
            (Liveness::KEEPALIVE_PROBES_ENV, "0"),
        ] {
            match Liveness::from_map_for_test(&[(var, value)]).unwrap_err() {
                BootstrapError::InvalidEnv {
                    var: v, value: x, ..
                } => {
                    assert_eq!((v.as_str(), x.as_str()), (var, value));
                }
                other => panic!("{var}={value}: unexpected {other:?}"),
            }
        }
        let cases: [(&[(&str, &str)], &str); 4] = [
            (
                &[(Liveness::HEARTBEAT_ENV, "3000")],
                "liveness.heartbeat_interval",
            ),
            (
                &[(Liveness::KEEPALIVE_PROBES_ENV, "500")],
                "liveness.keepalive_probes",
            ),
            (
                &[(Liveness::KEEPALIVE_IDLE_ENV, "40000000")],
                "liveness.keepalive_idle",
            ),
            (
                &[(Liveness::KEEPALIVE_INTERVAL_ENV, "40000000")],
                "liveness.keepalive_interval",
            ),
        ];
        for (vars, expected) in cases {
            match Liveness::from_map_for_test(vars).unwrap_err() {
                BootstrapError::InvalidConfig { field, .. } => assert_eq!(field, expected),
                other => panic!("{vars:?}: unexpected {other:?}"),
            }
        }
        // Disabled keepalive skips its checks; disabled heartbeats skip theirs.
        Liveness::from_map_for_test(&[
            (Liveness::KEEPALIVE_IDLE_ENV, "0"),
            (Liveness::KEEPALIVE_PROBES_ENV, "500"),
            (Liveness::PEER_TIMEOUT_ENV, "0"),
            (Liveness::HEARTBEAT_ENV, "9000"),
        ])
        .unwrap();
    }

    #[test]
    fn keepalive_is_applied_to_sockets() {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let l = Liveness {
            keepalive_idle: Duration::from_millis(2500),
            keepalive_interval: Duration::from_secs(1),
            keepalive_probes: 4,
            ..Liveness::default()
        };
        l.apply_keepalive(&client).unwrap();
        let s = SockRef::from(&client);
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(3));
        assert_eq!(s.tcp_keepalive_interval().unwrap(), Duration::from_secs(1));
        assert_eq!(s.tcp_keepalive_retries().unwrap(), 4);
        // Disabled: the socket is left alone.
        let off = Liveness {
            keepalive_idle: Duration::ZERO,
            ..l
        };
        off.apply_keepalive(&server).unwrap();
        assert!(!SockRef::from(&server).keepalive().unwrap());
    }

    impl Liveness {
        fn from_map_for_test(pairs: &[(&str, &str)]) -> Result<Liveness> {
            let vars = map(pairs);
            Liveness::from_lookup(|k| vars.get(k).cloned())
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
