//! Machine checks: what is known of this host (its GPUs, its memory, its file system) and
//! the rules that compare the flags with it.
//!
//! Contract: a rule that needs a fact skips when the fact is unknown ([`Machine::default`],
//! before the driver is asked), and every memory error is reported on `--tokens`.

use std::path::Path;

use epcomm_topology::Tiers;

use super::FlagError;
use crate::cli::BenchArgs;
use crate::gpu::GpuInfo;

/// What is known about the machine (nothing, before the driver is asked).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Machine {
    /// Visible GPUs, when the driver was asked.
    pub gpus: Option<Vec<GpuInfo>>,
    /// Host memory in bytes, when known.
    pub host_memory_bytes: Option<u64>,
}

impl Machine {
    /// This host's memory from `/proc/meminfo` (`MemTotal`), plus the given GPUs.
    pub fn with_gpus(gpus: Vec<GpuInfo>) -> Self {
        Self {
            gpus: Some(gpus),
            host_memory_bytes: std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|s| parse_mem_total(&s)),
        }
    }

    /// The smallest SM count and memory among the GPUs a run of `world` ranks uses (the first
    /// `world`, every GPU when ranks share them): `None` while the GPUs or the world are
    /// unknown.
    pub fn smallest_used(&self, world: Option<usize>) -> (Option<u32>, Option<u64>) {
        let used: Option<&[GpuInfo]> = match (self.gpus.as_deref(), world) {
            (Some(g), Some(w)) => g.get(..w.min(g.len())).filter(|g| !g.is_empty()),
            _ => None,
        };
        (
            used.and_then(|g| g.iter().map(|g| g.sms).min()),
            used.and_then(|g| g.iter().map(|g| g.memory_bytes).min()),
        )
    }
}

/// `MemTotal:  131899704 kB` → bytes.
pub fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut it = line.split_whitespace().skip(1);
    let v: u64 = it.next()?.parse().ok()?;
    match it.next() {
        Some("kB") | None => v.checked_mul(1024),
        Some(_) => None,
    }
}

/// Bytes as GiB with one decimal.
fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Estimated GPU memory one rank needs: the symmetric buffer (`BufferPlan`), the inputs, the
/// timing buffers (L2 flush, combine input and output) and 512 MiB for the context and
/// kernels. `None` when the sizes overflow.
pub fn device_bytes_estimate(
    world: usize,
    tokens: usize,
    hidden: usize,
    top_k: usize,
    experts: usize,
) -> Option<u128> {
    let plan = epcomm_topology::BufferPlan::new(world, tokens, hidden, top_k, experts).ok()?;
    let (w, t, h, k) = (world as u128, tokens as u128, hidden as u128, top_k as u128);
    let inputs = t * (h * 3 + h / 128 * 4 + k * 12);
    let timing = epcomm_check::timing::FLUSH_BYTES as u128 + w * t * h * 2 + t * h * 2;
    Some(u128::from(plan.total_bytes()) + inputs + timing + (512 << 20))
}

/// Estimated GPU memory one rank of `--hierarchical` needs: the rail stage's buffer (over the
/// nodes, `tokens` per rank), the node stage's (over the local ranks, as many tokens as the
/// rail stage receives, a node's experts), the combine partials, the inputs, the timing
/// buffers and 512 MiB for the context and kernels. `None` when a plan refuses the shape or
/// the sizes overflow.
pub fn hier_device_bytes_estimate(
    tiers: Tiers,
    tokens: usize,
    hidden: usize,
    top_k: usize,
    experts: usize,
) -> Option<u128> {
    use epcomm_topology::BufferPlan;
    let rail = BufferPlan::new(tiers.nodes(), tokens, hidden, top_k, experts).ok()?;
    let rail_rows = usize::try_from(rail.recv_rows()).ok()?;
    let node = BufferPlan::new(
        tiers.local_ranks(),
        rail_rows,
        hidden,
        top_k,
        experts / tiers.nodes(),
    )
    .ok()?;
    let (t, h, k) = (tokens as u128, hidden as u128, top_k as u128);
    let rows = u128::from(node.recv_rows());
    let partials = rail_rows as u128 * (h * 2 + k * 4);
    let inputs = t * (h * 3 + h / 128 * 4 + k * 12);
    let timing = epcomm_check::timing::FLUSH_BYTES as u128 + rows * h * 2 + t * h * 2;
    Some(
        u128::from(rail.total_bytes())
            + u128::from(node.total_bytes())
            + partials
            + inputs
            + timing
            + (512 << 20),
    )
}

/// Estimated host memory of the whole run: every worker generates every rank's inputs (and
/// the reference) on the host, about `world * tokens * hidden * 4` bytes each.
pub fn host_bytes_estimate(world: usize, tokens: usize, hidden: usize) -> u128 {
    let w = world as u128;
    w * w * tokens as u128 * hidden as u128 * 4
}

/// The memory the run needs against what the GPUs (`gpu_memory`: the smallest) and the host
/// have; all reported on `--tokens`. `per_rank`: the device estimate of one rank (`None`:
/// the sizes overflow), `ranks_per_gpu` ranks on each GPU.
pub(super) fn memory_errors(
    args: &BenchArgs,
    w: usize,
    per_rank: Option<u128>,
    ranks_per_gpu: usize,
    gpu_memory: Option<u64>,
    host_memory: Option<u64>,
) -> Vec<FlagError> {
    let (t, h) = (args.tokens(), args.hidden);
    let what = format!("--tokens {t} with --hidden {h} and --world {w}");
    let whose = if ranks_per_gpu > 1 {
        format!("GPU memory ({ranks_per_gpu} ranks share each GPU); the smallest GPU has")
    } else {
        "GPU memory per rank; the smallest GPU has".into()
    };
    let too_much = |need: u128, have: Option<u64>, whose: &str| {
        have.filter(|&have| need > u128::from(have))
            .map(|have| FlagError::Invalid {
                flag: "--tokens",
                why: format!(
                    "{what} needs about {} of {whose} {}",
                    gib(need),
                    gib(u128::from(have))
                ),
            })
    };
    let device = match per_rank {
        None => Some(FlagError::Invalid {
            flag: "--tokens",
            why: format!("{what}: buffer sizes overflow"),
        }),
        Some(need) => too_much(need * ranks_per_gpu as u128, gpu_memory, &whose),
    };
    let host = too_much(
        host_bytes_estimate(w, t, h),
        host_memory,
        "host memory (every worker generates every rank's inputs); this host has",
    );
    device.into_iter().chain(host).collect()
}

/// `--plot`: a file name in a directory that exists.
pub(super) fn plot_path_error(p: &Path) -> Option<FlagError> {
    if p.as_os_str().is_empty() {
        return Some(FlagError::Invalid {
            flag: "--plot",
            why: "empty path".into(),
        });
    }
    if p.is_dir() {
        return Some(FlagError::Invalid {
            flag: "--plot",
            why: format!("{} is a directory; give a file name", p.display()),
        });
    }
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Some(FlagError::Invalid {
            flag: "--plot",
            why: format!("directory {} does not exist", dir.display()),
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{args, error_about, gpus};
    use super::super::validate_bench;
    use super::*;

    #[test]
    fn tokens_over_gpu_memory() {
        let m = Machine {
            gpus: Some(gpus(8, 132, 1)),
            host_memory_bytes: None,
        };
        let err = validate_bench(&args(&["--world", "8"]), None, &m).unwrap_err();
        let e = err.about("--tokens").expect("memory error");
        assert!(e.to_string().contains("GPU memory"), "{e}");
        let m = Machine {
            gpus: Some(gpus(8, 132, 141)),
            host_memory_bytes: Some(1 << 30),
        };
        let err = validate_bench(&args(&["--world", "8"]), None, &m).unwrap_err();
        assert!(err.to_string().contains("host memory"), "{err}");
    }

    #[test]
    fn plot_directory_must_exist() {
        let e = error_about(
            &[
                "--sweep-sms",
                "16",
                "--plot",
                "/nonexistent-dir-epcomm/x.svg",
            ],
            "--plot",
        );
        assert!(e.to_string().contains("does not exist"), "{e}");
        error_about(&["--sweep-sms", "16", "--plot", "/"], "--plot");
    }

    #[test]
    fn meminfo_parses() {
        assert_eq!(
            parse_mem_total("MemFree: 1 kB\nMemTotal:  2048 kB\n"),
            Some(2 << 20)
        );
        assert_eq!(parse_mem_total("nothing"), None);
    }
}
