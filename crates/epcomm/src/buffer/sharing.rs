//! Ranks sharing one GPU: a check [`Buffer::new`](super::Buffer::new) makes across the world.
//!
//! Every op's kernels wait for blocks of the peers' kernels (completion counters, count rows,
//! data flags), so every block of every rank's op must be resident at once. The per-process
//! check in `setup` covers one rank's grid. Under MPS the ranks that share a GPU run their
//! kernels side by side on its SMs: `ranks × num_sms` blocks must fit together, or the blocks
//! that are resident spin for blocks that can never be scheduled until the op times out, on
//! every rank. Without MPS the ranks' contexts take turns on the whole GPU (time slices), so
//! each rank's grid fits on its own and only the per-process check applies (ops are slow, not
//! stuck).
//!
//! Every rank all-gathers its [`GpuPlacement`] and runs the same check over all of them, so a
//! GPU that is oversubscribed fails `Buffer::new` on every rank of the world at once (a rank
//! whose own GPU fits would otherwise go on to the collective allocation and wait there).

use crate::{Error, Result};

/// Where one rank runs: what the sharing check needs of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GpuPlacement {
    /// The GPU's UUID (a MIG instance has its own; unique across hosts).
    pub(super) uuid: [u8; 16],
    /// The rank's context runs under MPS (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`).
    pub(super) mps: bool,
    /// SMs of the GPU, as the rank's context sees it.
    pub(super) sms: u32,
    /// Blocks of the op kernels that fit on the GPU at once (the rank's occupancy check).
    pub(super) fit: u32,
    /// The rank's `num_sms`.
    pub(super) num_sms: u32,
    /// The rank's `ll_num_sms` (0: automatic, [`ll_blocks`]).
    pub(super) ll_num_sms: u32,
}

/// Bytes of [`GpuPlacement::encode`].
const ENCODED: usize = 16 + 1 + 4 + 4 + 4 + 4;

impl GpuPlacement {
    /// Bytes for the all-gather.
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(ENCODED);
        v.extend_from_slice(&self.uuid);
        v.push(u8::from(self.mps));
        v.extend_from_slice(&self.sms.to_le_bytes());
        v.extend_from_slice(&self.fit.to_le_bytes());
        v.extend_from_slice(&self.num_sms.to_le_bytes());
        v.extend_from_slice(&self.ll_num_sms.to_le_bytes());
        v
    }

    /// The placement `rank` sent, or an error naming it.
    pub(super) fn decode(rank: usize, bytes: &[u8]) -> Result<Self> {
        let bad = || {
            Error::Failed(format!(
                "rank {rank} sent a GPU placement of {} bytes ({ENCODED} expected): every rank \
                 must run the same epcomm build",
                bytes.len()
            ))
        };
        if bytes.len() != ENCODED {
            return Err(bad());
        }
        let word = |at: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&bytes[at..at + 4]);
            u32::from_le_bytes(w)
        };
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&bytes[..16]);
        Ok(Self {
            uuid,
            mps: bytes[16] != 0,
            sms: word(17),
            fit: word(21),
            num_sms: word(25),
            ll_num_sms: word(29),
        })
    }

    /// The GPU's UUID as text (`GPU-xxxxxxxx-xxxx-...`, as `nvidia-smi -L` prints it).
    fn gpu_name(&self) -> String {
        let h: String = self.uuid.iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "GPU-{}-{}-{}-{}-{}",
            &h[..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..]
        )
    }
}

/// The largest `num_sms` with which `ranks` ranks fit together on a GPU of `blocks` resident
/// blocks (0 when not even one block each fits).
pub(super) fn largest_fitting_num_sms(blocks: u32, ranks: usize) -> u32 {
    if ranks == 0 {
        return blocks;
    }
    u32::try_from(blocks as usize / ranks).unwrap_or(u32::MAX)
}

/// The ranks whose kernels run side by side with rank `r`'s, `r` included: those on its GPU
/// when any of them runs under MPS, else `r` alone (time-sliced contexts each have the GPU to
/// themselves).
fn side_by_side(all: &[GpuPlacement], r: usize) -> usize {
    let same: Vec<usize> = (0..all.len())
        .filter(|&q| all[q].uuid == all[r].uuid)
        .collect();
    if same.iter().any(|&q| all[q].mps) {
        same.len()
    } else {
        1
    }
}

/// The low-latency kernels' blocks on every rank: `ll_num_sms` when the ranks set it, else the
/// most every rank can have, its GPU's resident blocks divided among the ranks whose kernels
/// run beside its own. The same on every rank (the kernels' counters count the peers' blocks).
pub(super) fn ll_blocks(all: &[GpuPlacement], ll_num_sms: u32) -> u32 {
    if ll_num_sms > 0 {
        return ll_num_sms;
    }
    (0..all.len())
        .map(|r| largest_fitting_num_sms(all[r].sms.min(all[r].fit), side_by_side(all, r)))
        .min()
        .unwrap_or(0)
        .max(1)
}

/// Fails unless, on every GPU that ranks share under MPS, the ranks' grids fit at once:
/// `Σ num_sms ≤ min(SMs, blocks that fit)`, and the same for an `ll_num_sms` the ranks set.
/// `all[r]` is world rank `r`'s placement; the error names the GPU, its ranks, the field and
/// the largest value that fits.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `num_sms` or `ll_num_sms`.
pub(super) fn check_shared_gpus(all: &[GpuPlacement]) -> Result<()> {
    check_field(all, "num_sms", |p| p.num_sms)?;
    check_field(all, "ll_num_sms", |p| p.ll_num_sms)
}

fn check_field(
    all: &[GpuPlacement],
    field: &'static str,
    get: impl Fn(&GpuPlacement) -> u32,
) -> Result<()> {
    let mut seen: Vec<[u8; 16]> = Vec::new();
    for p in all {
        if seen.contains(&p.uuid) {
            continue;
        }
        seen.push(p.uuid);
        let ranks: Vec<usize> = (0..all.len()).filter(|&r| all[r].uuid == p.uuid).collect();
        if ranks.len() < 2 || !ranks.iter().any(|&r| all[r].mps) {
            // Alone on its GPU, or time-sliced contexts: each grid has the GPU to itself.
            continue;
        }
        let blocks = ranks
            .iter()
            .map(|&r| all[r].sms.min(all[r].fit))
            .min()
            .unwrap_or(0);
        let asked: u64 = ranks.iter().map(|&r| u64::from(get(&all[r]))).sum();
        if asked <= u64::from(blocks) {
            continue;
        }
        let n = ranks.len();
        let value = get(&all[ranks[0]]);
        let largest = largest_fitting_num_sms(blocks, n);
        let fix = if largest == 0 {
            format!("no {field} fits: run at most {blocks} ranks on one GPU")
        } else {
            format!("set {field} to at most {largest} = {blocks} / {n}")
        };
        return Err(Error::InvalidArgument {
            argument: field,
            rule: format!(
                "{n} ranks ({}) share {} under MPS, where their kernels run side by side: \
                 {n} x {field} = {asked} blocks cannot all be resident on its {blocks} \
                 (SMs, or fewer when fewer blocks of the op kernels fit), and the ops' \
                 cross-rank waits would time out; {fix} (got {field} = {value})",
                list(&ranks),
                p.gpu_name(),
            ),
        });
    }
    Ok(())
}

/// `0, 1, 2` (the first 8 and a count of the rest).
fn list(ranks: &[usize]) -> String {
    let mut s: Vec<String> = ranks.iter().take(8).map(|r| r.to_string()).collect();
    if ranks.len() > 8 {
        s.push(format!("and {} more", ranks.len() - 8));
    }
    format!("ranks {}", s.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(gpu: u8, mps: bool, num_sms: u32) -> GpuPlacement {
        GpuPlacement {
            uuid: [gpu; 16],
            mps,
            sms: 132,
            fit: 264,
            num_sms,
            ll_num_sms: 0,
        }
    }

    #[test]
    fn low_latency_blocks_default_to_every_sm_a_rank_may_use() {
        // Alone on a GPU, or time-sliced without MPS: the whole GPU.
        assert_eq!(ll_blocks(&[at(1, false, 24), at(2, false, 24)], 0), 132);
        assert_eq!(ll_blocks(&[at(1, false, 24), at(1, false, 24)], 0), 132);
        // Two ranks on one GPU under MPS, one alone on another: every rank gets 66.
        assert_eq!(
            ll_blocks(&[at(1, true, 24), at(1, true, 24), at(2, true, 24)], 0),
            66
        );
        // Fewer resident blocks than SMs bound it too; a value the ranks set is kept.
        let mut few = at(1, false, 24);
        few.fit = 100;
        assert_eq!(ll_blocks(&[few], 0), 100);
        assert_eq!(ll_blocks(&[few], 8), 8);
        // An explicit value that does not fit beside the other ranks is refused, naming it.
        let mut big = vec![at(1, true, 16); 4];
        for p in &mut big {
            p.ll_num_sms = 40;
        }
        let e = check_shared_gpus(&big).unwrap_err().to_string();
        assert!(e.contains("ll_num_sms") && e.contains("at most 33"), "{e}");
    }

    #[test]
    fn placements_round_trip_and_a_short_one_is_refused() {
        let p = GpuPlacement {
            uuid: *b"0123456789abcdef",
            mps: true,
            sms: 132,
            fit: 132,
            num_sms: 24,
            ll_num_sms: 8,
        };
        assert_eq!(GpuPlacement::decode(3, &p.encode()).unwrap(), p);
        let e = GpuPlacement::decode(3, &p.encode()[..20])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 3") && e.contains("20 bytes"), "{e}");
    }

    #[test]
    fn largest_fitting_value_divides_the_blocks_among_the_ranks() {
        assert_eq!(largest_fitting_num_sms(132, 8), 16);
        assert_eq!(largest_fitting_num_sms(132, 4), 33);
        assert_eq!(largest_fitting_num_sms(132, 1), 132);
        assert_eq!(largest_fitting_num_sms(132, 200), 0);
    }

    #[test]
    fn ranks_sharing_a_gpu_under_mps_must_fit_together() {
        // 8 ranks x 24 SMs on one 132-SM GPU under MPS: refused, naming 16 as the largest.
        let all = vec![at(1, true, 24); 8];
        let e = check_shared_gpus(&all).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    argument: "num_sms",
                    ..
                }
            ),
            "{text}"
        );
        assert!(
            text.contains("8 ranks (ranks 0, 1, 2, 3, 4, 5, 6, 7)")
                && text.contains("at most 16 = 132 / 8")
                && text.contains("got num_sms = 24")
                && text.contains("GPU-01010101-0101-0101-0101-010101010101"),
            "{text}"
        );
        // 8 x 16 fits; so do 8 x 24 without MPS (time-sliced) and 8 ranks on 8 GPUs.
        check_shared_gpus(&vec![at(1, true, 16); 8]).unwrap();
        check_shared_gpus(&vec![at(1, false, 24); 8]).unwrap();
        check_shared_gpus(&(0..8).map(|g| at(g, true, 24)).collect::<Vec<_>>()).unwrap();
    }

    #[test]
    fn only_the_oversubscribed_gpu_is_named_and_fewer_fitting_blocks_bind() {
        // Ranks 0-1 on GPU 1, ranks 2-5 on GPU 2 (4 x 40 > 132).
        let mut all = vec![at(1, true, 40); 2];
        all.extend(vec![at(2, true, 40); 4]);
        let text = check_shared_gpus(&all).unwrap_err().to_string();
        assert!(
            text.contains("4 ranks (ranks 2, 3, 4, 5)") && text.contains("at most 33"),
            "{text}"
        );
        // Occupancy below one block per SM binds: 100 blocks fit, 2 x 60 do not.
        let mut small = vec![at(1, true, 60); 2];
        for p in &mut small {
            p.fit = 100;
        }
        let text = check_shared_gpus(&small).unwrap_err().to_string();
        assert!(text.contains("at most 50 = 100 / 2"), "{text}");
        // More ranks than blocks: no value fits.
        let text = check_shared_gpus(&vec![at(1, true, 1); 140])
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("no num_sms fits") && text.contains("and 132 more"),
            "{text}"
        );
    }
}
