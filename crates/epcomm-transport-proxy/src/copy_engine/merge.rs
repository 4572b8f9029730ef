//! How the copy-engine executor merges the copies it holds: a pending copy's type
//! ([`Pending`]), the rules a new copy merges by ([`joined_copy`], [`signal_continued`]), the
//! pass before a batch goes out ([`compact`], [`regroup_fills`]), and the counting table's
//! copies ([`counted_source`]). Every rule keeps each signal behind the copies before it and
//! every two copies of shared bytes in order (see the parent module's "Ordering").

use epcomm_proxy::OpId;
use epcomm_proxy::descriptor::{Write, WriteWidth};

/// Elements of the counting table (`u32` 0, 1, 2, ...): a 4-byte write whose values all lie
/// below it is a copy from the table instead of staged bytes.
pub(super) const COUNTING_ELEMS: u64 = 1 << 18;

/// How far back in a lane's pending copies a new copy looks for one it continues.
pub(super) const MERGE_WINDOW: usize = 32;

/// How far back [`compact`] looks, once per batch (each copy of a batch that merges with
/// nothing costs that many comparisons: about 5% of its `cuMemcpyAsync` at 64).
pub(super) const COMPACT_WINDOW: usize = 64;

/// A copy not yet handed to its lane's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Pending {
    pub(super) dst: u64,
    pub(super) src: u64,
    pub(super) bytes: usize,
    /// The first operation it carries (named when the driver refuses the copy).
    pub(super) op: OpId,
    /// It carries signal words only: it lands after every copy before it, so it never moves
    /// ahead of one, and copies of data never merge into it.
    signal: bool,
    /// A signal copy of set words that all hold this value (`None`: data, an add's running
    /// sum, or words of several values): such copies may be laid out anew ([`regroup_fills`]).
    fill: Option<u64>,
}

impl Pending {
    pub(super) fn data(dst: u64, src: u64, bytes: usize, op: OpId) -> Self {
        Self {
            dst,
            src,
            bytes,
            op,
            signal: false,
            fill: None,
        }
    }

    pub(super) fn signal(dst: u64, src: u64, bytes: usize, op: OpId, fill: Option<u64>) -> Self {
        Self {
            signal: true,
            fill,
            ..Self::data(dst, src, bytes, op)
        }
    }

    /// Appends signal copy `next` (which continues this one) to it.
    fn extend_signal(&mut self, next: &Pending) {
        self.bytes += next.bytes;
        if self.fill != next.fill {
            self.fill = None;
        }
    }
}

/// Where in the counting table at `table` (holding `u32` 0, 1, 2, ... up to
/// `COUNTING_ELEMS`) the bytes of write `w` already lie: 4-byte elements whose values all lie
/// below the table's end. Consecutive sequences (a dispatch's source indices, run after run)
/// then continue each other in source and destination alike, and merge as rows do.
pub(super) fn counted_source(table: u64, w: &Write) -> Option<u64> {
    let end = w.value.checked_add(u64::from(w.count))?;
    (w.width == WriteWidth::Four && end <= COUNTING_ELEMS).then(|| table + 4 * w.value)
}

/// Whether `[a, a + a_len)` and `[b, b + b_len)` share a byte.
fn overlaps(a: u64, a_len: usize, b: u64, b_len: usize) -> bool {
    a < b.saturating_add(b_len as u64) && b < a.saturating_add(a_len as u64)
}

/// Whether the copy of `bytes` bytes from `src` to `dst` depends on a copy in `batch` or one
/// of them on it: it writes what one reads or writes, or reads what one writes. Such copies
/// may not share a `cuMemcpyBatchAsync` (it runs them in no particular order).
pub(super) fn depends_on_any(batch: &[Pending], dst: u64, src: u64, bytes: usize) -> bool {
    batch.iter().any(|c| touches(c, dst, src, bytes))
}

/// Whether pending copy `c` and the copy of `bytes` bytes from `src` to `dst` conflict: one
/// writes what the other reads or writes.
fn touches(c: &Pending, dst: u64, src: u64, bytes: usize) -> bool {
    overlaps(c.dst, c.bytes, dst, bytes)
        || overlaps(c.src, c.bytes, dst, bytes)
        || overlaps(c.dst, c.bytes, src, bytes)
}

/// The index of `batch`'s last copy when it holds signals only and a signal's copy from `src`
/// to `dst` continues it: both its source and its destination start where that copy ends.
/// Only the last copy qualifies, so the merged signal still lands after every copy before it.
fn signal_continued(batch: &[Pending], dst: u64, src: u64) -> Option<usize> {
    let k = batch.len().checked_sub(1)?;
    let c = batch[k];
    (c.signal
        && c.dst.checked_add(c.bytes as u64) == Some(dst)
        && c.src.checked_add(c.bytes as u64) == Some(src))
    .then_some(k)
}

/// How many copies of `batch` carry signal words, data under `small` bytes, and larger data.
pub(super) fn kinds_of(batch: &[Pending], small: usize) -> (usize, usize, usize) {
    let signal = batch.iter().filter(|c| c.signal).count();
    let under = batch
        .iter()
        .filter(|c| !c.signal && c.bytes < small)
        .count();
    (signal, under, batch.len() - signal - under)
}

/// Where a new copy joins a pending one ([`joined_copy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Join {
    /// The new copy continues the pending one (both its source and its destination start
    /// where the pending copy's end).
    After,
    /// The new copy precedes the pending one (both end where the pending copy's start): the
    /// merged copy starts at the new one's addresses.
    Before,
}

/// Merges `copy` into `into` on `side` (as [`joined_copy`] found it).
fn join(into: &mut Pending, copy: &Pending, side: Join) {
    if side == Join::Before {
        into.dst = copy.dst;
        into.src = copy.src;
    }
    into.bytes += copy.bytes;
}

/// The index of the pending copy of data in `batch` that data copy `copy` joins (continues
/// it, or ends where it starts, in both its source and its destination), when merging them
/// leaves the stream's result unchanged: no copy issued between the two reads or writes the
/// new destination or writes the new source, and the merged copy's source and destination do
/// not overlap. A signal's copy is never joined (data merged into it could land with it, and
/// it must not move), though the copies between are checked against it too. Looks back at
/// most `window` copies. Both sides matter because warps hand the proxy adjacent runs in no
/// particular order: a run arriving before its neighbour to the left must still merge with it.
fn joined_copy(batch: &[Pending], copy: &Pending, window: usize) -> Option<(usize, Join)> {
    let (dst, src, bytes) = (copy.dst, copy.src, copy.bytes);
    let lo = batch.len().saturating_sub(window);
    for k in (lo..batch.len()).rev() {
        let c = &batch[k];
        if !c.signal {
            let (d, s, n) = (c.dst, c.src, c.bytes);
            let merged = n + bytes;
            if d.checked_add(n as u64) == Some(dst) && s.checked_add(n as u64) == Some(src) {
                return (!overlaps(d, merged, s, merged)).then_some((k, Join::After));
            }
            if dst.checked_add(bytes as u64) == Some(d) && src.checked_add(bytes as u64) == Some(s)
            {
                return (!overlaps(dst, merged, src, merged)).then_some((k, Join::Before));
            }
        }
        if touches(c, dst, src, bytes) {
            return None;
        }
    }
    None
}

/// Merges the copies of `batch` that continue each other, before it goes out: first the
/// chains of independent copies of data over the whole batch ([`merge_independent`]), then, in
/// one pass, under the rules a new copy merges by: a copy of data joins an earlier one
/// ([`joined_copy`], looking back `window` copies), a signal's copy only the copy just before
/// it when that is a signal's ([`signal_continued`]). A batch `A, C, B` where `B` joined `A`
/// leaves `AB, C` at push time (`C` came first); here `C` joins `AB`.
pub(super) fn compact(batch: &mut Vec<Pending>, window: usize) {
    if batch.len() < 2 {
        return;
    }
    merge_independent(batch);
    let mut out: Vec<Pending> = Vec::with_capacity(batch.len());
    for c in batch.drain(..) {
        if !merged_into(&mut out, &c, window) {
            out.push(c);
        }
    }
    regroup_fills(&mut out);
    *batch = out;
}

/// Merges copy `c` into a copy of `batch` by the rules of a new copy (data joins an earlier
/// copy of data within `window`, [`joined_copy`]; a signal's copy only the last copy when
/// that holds signals, [`signal_continued`]); false when it merged into none.
pub(super) fn merged_into(batch: &mut [Pending], c: &Pending, window: usize) -> bool {
    if c.signal {
        if let Some(k) = signal_continued(batch, c.dst, c.src) {
            batch[k].extend_signal(c);
            return true;
        }
    } else if let Some((k, side)) = joined_copy(batch, c, window) {
        join(&mut batch[k], c, side);
        return true;
    }
    false
}

/// Merges, across the whole of `batch`, each chain of **independent** copies of data that
/// continue each other (sorted by destination, each starts where the one before ends, in its
/// source and its destination) into one copy, at the place of the chain's earliest member.
/// Independent: no other copy of the batch writes the bytes it reads or writes, or reads the
/// bytes it writes, and its own source and destination are apart; so moving it earlier
/// changes nothing but when it lands, and data may land before a signal that followed it
/// (never after one that preceded it: the merged copy takes the earliest place). The warps
/// hand the proxy neighbouring runs in no particular order, so in a batch held together (a
/// linger, or copies waiting behind running batches) a run's neighbours are often further
/// back than any window: this pass finds them in `O(n log n)`.
pub(super) fn merge_independent(batch: &mut Vec<Pending>) {
    let n = batch.len();
    if batch.iter().filter(|c| !c.signal).take(2).count() < 2 {
        return;
    }
    let free = independent(batch);
    let mut chain: Vec<usize> = (0..n).filter(|&k| free[k]).collect();
    if chain.len() < 2 {
        return;
    }
    chain.sort_by_key(|&k| batch[k].dst);
    let mut keep = vec![true; n];
    let mut i = 0;
    while i < chain.len() {
        let mut merged = batch[chain[i]];
        let mut place = chain[i];
        let mut j = i + 1;
        while j < chain.len() {
            let c = batch[chain[j]];
            // Independent copies are apart from each other's and their own bytes, so the
            // merged copy's source and destination are apart too.
            let continues = merged.dst.checked_add(merged.bytes as u64) == Some(c.dst)
                && merged.src.checked_add(merged.bytes as u64) == Some(c.src);
            let Some(total) = merged.bytes.checked_add(c.bytes).filter(|_| continues) else {
                break;
            };
            merged.bytes = total;
            place = place.min(chain[j]);
            j += 1;
        }
        if j > i + 1 {
            for &k in &chain[i..j] {
                keep[k] = false;
            }
            keep[place] = true;
            merged.op = batch[place].op;
            batch[place] = merged;
        }
        i = j;
    }
    let mut k = 0;
    batch.retain(|_| {
        k += 1;
        keep[k - 1]
    });
}

/// How a batch goes out over several streams of one lane ([`stripes`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Stripes {
    /// The copies that go first, side by side: (index in the batch, stream; 0 is the lane's).
    pub(super) lead: Vec<(usize, usize)>,
    /// Every other copy's index, in batch order: on stream 0 once every lead copy is complete.
    pub(super) rest: Vec<usize>,
}

/// How a batch goes out over `streams` streams of one lane (stream 0 is the lane's own, whose
/// events mark completion): the lead copies are the independent copies of data
/// ([`independent`]) of at least `min_bytes` bytes, each with its stream (largest first, each
/// to the stream with the fewest bytes so far), and the rest follow in batch order. The lead
/// copies touch no byte another copy of the batch touches, so running them first and side by
/// side changes nothing but when they land (the parent module's "Copy streams"). `None` when
/// fewer than two copies lead: one stream then takes the batch as it is.
pub(super) fn stripes(batch: &[Pending], streams: usize, min_bytes: usize) -> Option<Stripes> {
    if streams < 2 || batch.len() < 2 {
        return None;
    }
    let free = independent(batch);
    let mut lead: Vec<usize> = (0..batch.len())
        .filter(|&k| free[k] && batch[k].bytes >= min_bytes)
        .collect();
    if lead.len() < 2 {
        return None;
    }
    lead.sort_by_key(|&k| std::cmp::Reverse(batch[k].bytes));
    let mut load = vec![0usize; streams];
    let lead: Vec<(usize, usize)> = lead
        .into_iter()
        .map(|k| {
            let s = (0..streams).min_by_key(|&s| load[s]).unwrap_or(0);
            load[s] = load[s].saturating_add(batch[k].bytes);
            (k, s)
        })
        .collect();
    let mut leads = vec![false; batch.len()];
    lead.iter().for_each(|&(k, _)| leads[k] = true);
    let rest = (0..batch.len()).filter(|&k| !leads[k]).collect();
    Some(Stripes { lead, rest })
}

/// Per copy of `batch`: whether it is a copy of data, of at least one byte, that no other copy
/// of the batch conflicts with (writes what it reads or writes, or reads what it writes), whose
/// own source and destination do not overlap. Two sweeps over the intervals sorted by start.
fn independent(batch: &[Pending]) -> Vec<bool> {
    let n = batch.len();
    let mut free: Vec<bool> = batch
        .iter()
        .map(|c| !c.signal && c.bytes > 0 && !overlaps(c.dst, c.bytes, c.src, c.bytes))
        .collect();
    // Intervals [start, end) with their copy: destinations (written) and sources (read).
    let span = |a: u64, len: usize| (a, a.saturating_add(len as u64));
    let mut writes: Vec<(u64, u64, usize)> = (0..n)
        .map(|k| {
            let (s, e) = span(batch[k].dst, batch[k].bytes);
            (s, e, k)
        })
        .collect();
    let mut reads: Vec<(u64, u64, usize)> = (0..n)
        .map(|k| {
            let (s, e) = span(batch[k].src, batch[k].bytes);
            (s, e, k)
        })
        .collect();
    writes.sort_unstable();
    reads.sort_unstable();
    // Two writes that overlap: sorted by start, an interval overlaps a later one exactly when
    // it overlaps the next, and an earlier one exactly when it starts before their largest end.
    let mut max_end = 0u64;
    for w in 0..n {
        let (s, e, k) = writes[w];
        if w > 0 && s < max_end {
            free[k] = false;
        }
        if w + 1 < n && e > writes[w + 1].0 {
            free[k] = false;
        }
        max_end = max_end.max(e);
    }
    // A write and a read that overlap (a copy's own pair too, which the check above already
    // excluded).
    let prefix_max = |v: &[(u64, u64, usize)]| -> Vec<u64> {
        v.iter()
            .scan(0u64, |m, &(_, e, _)| {
                *m = (*m).max(e);
                Some(*m)
            })
            .collect()
    };
    let (reads_max, writes_max) = (prefix_max(&reads), prefix_max(&writes));
    let hit = |sorted: &[(u64, u64, usize)], max: &[u64], s: u64, e: u64| {
        // Intervals starting before `e`; one of them ends after `s`.
        let m = sorted.partition_point(|&(start, _, _)| start < e);
        m > 0 && max[m - 1] > s
    };
    for &(s, e, k) in &writes {
        if free[k] && hit(&reads, &reads_max, s, e) {
            free[k] = false;
        }
    }
    for &(s, e, k) in &reads {
        if free[k] && hit(&writes, &writes_max, s, e) {
            free[k] = false;
        }
    }
    free
}

/// Lays out anew each group of consecutive signal copies in `batch` that set words to one
/// value and read one contiguous stretch of staged bytes (a combine's runs of flags, staged
/// in arrival order, bound for slots in token order): sorted by destination, the copies whose
/// destinations touch become one, each reading its bytes from the stretch in turn (every word
/// of it holds the value). The group stays where it was, after every copy before it, so each
/// signal still lands after everything that came before it in the ring; only the order among
/// the group's words changes, and those are set words of one value at distinct places (a
/// group whose destinations overlap is left alone).
pub(super) fn regroup_fills(batch: &mut Vec<Pending>) {
    let mut k = 0;
    while k < batch.len() {
        let Some(value) = batch[k].fill else {
            k += 1;
            continue;
        };
        let end = (k..batch.len())
            .find(|&j| batch[j].fill != Some(value))
            .unwrap_or(batch.len());
        match (end - k >= 2).then(|| regrouped(&batch[k..end])).flatten() {
            Some(merged) => {
                let n = merged.len();
                batch.splice(k..end, merged);
                k += n;
            }
            None => k = end,
        }
    }
}

/// The group `group` (set copies of one value, see [`regroup_fills`]) as fewer copies, or
/// `None` when its staged bytes are not one stretch, its destinations overlap, or nothing
/// would merge.
fn regrouped(group: &[Pending]) -> Option<Vec<Pending>> {
    let mut by_src: Vec<&Pending> = group.iter().collect();
    by_src.sort_by_key(|c| c.src);
    if by_src
        .windows(2)
        .any(|w| w[0].src.checked_add(w[0].bytes as u64) != Some(w[1].src))
    {
        return None;
    }
    let mut src = by_src[0].src;
    let mut by_dst: Vec<&Pending> = group.iter().collect();
    by_dst.sort_by_key(|c| c.dst);
    let mut out: Vec<Pending> = Vec::with_capacity(group.len());
    for c in by_dst {
        match out.last_mut() {
            Some(last) if last.dst.saturating_add(last.bytes as u64) > c.dst => return None,
            Some(last) if last.dst.saturating_add(last.bytes as u64) == c.dst => {
                last.bytes += c.bytes
            }
            _ => out.push(Pending { src, ..*c }),
        }
        src += c.bytes as u64;
    }
    (out.len() < group.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pending copy of data.
    fn d(dst: u64, src: u64, bytes: usize) -> Pending {
        Pending::data(dst, src, bytes, 0)
    }

    /// A pending copy of signal words (not a set of one value).
    fn sg(dst: u64, src: u64, bytes: usize) -> Pending {
        Pending::signal(dst, src, bytes, 0, None)
    }

    /// A pending copy of set words holding `value`.
    fn set(dst: u64, src: u64, bytes: usize, value: u64) -> Pending {
        Pending::signal(dst, src, bytes, 0, Some(value))
    }

    /// A seeded xorshift generator: `rand(m)` is in `0..m`.
    fn xorshift(mut state: u64) -> impl FnMut(u64) -> u64 {
        move |m| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % m
        }
    }

    fn joined(b: &[Pending], dst: u64, src: u64, bytes: usize) -> Option<(usize, Join)> {
        joined_copy(b, &d(dst, src, bytes), MERGE_WINDOW)
    }

    #[test]
    fn a_chain_of_independent_copies_merges_at_its_earliest_member() {
        // Neighbours in any order, a signal between: one copy where the first of them was;
        // the signal keeps its place after it.
        // The merged copy carries the operation of the copy whose place it takes.
        let op = |c: Pending, op: OpId| Pending { op, ..c };
        let mut b = vec![
            op(d(1064, 50_064, 64), 7),
            op(sg(9000, 70_000, 8), 8),
            op(d(1000, 50_000, 64), 9),
            op(d(1128, 50_128, 64), 10),
        ];
        merge_independent(&mut b);
        assert_eq!(
            b,
            vec![op(d(1000, 50_000, 192), 7), op(sg(9000, 70_000, 8), 8)]
        );
    }

    /// [`independent`] against the pairwise rule ([`touches`], [`overlaps`]) on random
    /// byte-granular copies, empty ones and ones near the end of the address space included:
    /// a copy it calls free conflicts with no other copy and not with itself; with no empty
    /// copy in the batch it says exactly what the pairwise rule says.
    #[test]
    fn independence_is_the_pairwise_rule() {
        let mut rand = xorshift(0x1234_5678_9ABC_DEF1);
        for case in 0..20_000 {
            let n = 1 + rand(12) as usize;
            let high = case % 7 == 0;
            let addr = |r: &mut dyn FnMut(u64) -> u64| {
                let a = r(96);
                if high { u64::MAX - 200 + a } else { a }
            };
            let b: Vec<Pending> = (0..n)
                .map(|_| {
                    let (dst, src) = (addr(&mut rand), addr(&mut rand));
                    let bytes = rand(if case % 3 == 0 { 9 } else { 24 }) as usize;
                    if rand(5) == 0 {
                        sg(dst, src, bytes)
                    } else {
                        d(dst, src, bytes)
                    }
                })
                .collect();
            let free = independent(&b);
            let empty = b.iter().any(|c| c.bytes == 0);
            for k in 0..n {
                let c = &b[k];
                let pairwise = !c.signal
                    && c.bytes > 0
                    && !overlaps(c.dst, c.bytes, c.src, c.bytes)
                    && (0..n).all(|o| o == k || !touches(&b[o], c.dst, c.src, c.bytes));
                if free[k] {
                    assert!(pairwise, "case {case}: copy {k} of {b:?} called free");
                } else if !empty {
                    assert!(!pairwise, "case {case}: copy {k} of {b:?} not called free");
                }
            }
        }
    }

    #[test]
    fn a_copy_that_another_copy_conflicts_with_stays_in_place() {
        // The third reads what the second writes, after it: merged with the first (before
        // the second) it would read the bytes from before.
        let mut b = vec![d(2000, 936, 64), d(1000, 5000, 64), d(2064, 1000, 64)];
        let before = b.clone();
        merge_independent(&mut b);
        assert_eq!(b, before);
        // The second writes what the third writes.
        let mut b = vec![d(2000, 936, 64), d(2100, 5000, 8), d(2064, 1000, 64)];
        let before = b.clone();
        merge_independent(&mut b);
        assert_eq!(b, before);
        // The second reads what the first writes.
        let mut b = vec![d(2000, 936, 64), d(7000, 2010, 8), d(2064, 1000, 64)];
        let before = b.clone();
        merge_independent(&mut b);
        assert_eq!(b, before);
        // Nothing in the way: the two merge.
        let mut b = vec![d(2000, 936, 64), d(7000, 5000, 64), d(2064, 1000, 64)];
        merge_independent(&mut b);
        assert_eq!(b, vec![d(2000, 936, 128), d(7000, 5000, 64)]);
    }

    #[test]
    fn a_batch_is_counted_by_kind() {
        let b = vec![
            d(0, 100, 64),
            sg(9000, 70_000, 8),
            d(2000, 5000, 4096),
            d(8000, 9000, 4095),
        ];
        assert_eq!(kinds_of(&b, 4096), (1, 2, 1));
        assert_eq!(kinds_of(&[], 4096), (0, 0, 0));
    }

    #[test]
    fn consecutive_rows_to_consecutive_slots_merge() {
        let mut b = vec![d(1000, 50_000, 64)];
        assert_eq!(joined(&b, 1064, 50_064, 64), Some((0, Join::After)));
        // Interleaved copies of other kinds (metadata rows elsewhere) do not stop it.
        b.push(d(9000, 70_000, 8));
        b.push(d(9100, 71_000, 8));
        assert_eq!(joined(&b, 1064, 50_064, 64), Some((0, Join::After)));
        assert_eq!(joined(&b, 9008, 70_008, 8), Some((1, Join::After)));
    }

    #[test]
    fn only_both_sides_continuing_merge() {
        let b = vec![d(1000, 50_000, 64)];
        assert_eq!(joined(&b, 1064, 60_000, 64), None, "source jumps");
        assert_eq!(joined(&b, 2000, 50_064, 64), None, "destination jumps");
        assert_eq!(joined(&b, 1000, 50_000, 64), None, "the same copy again");
        assert_eq!(joined(&[], 1064, 50_064, 64), None);
    }

    #[test]
    fn a_run_that_arrives_before_its_left_neighbour_joins_it_from_the_front() {
        // Rows 64..128 came first; rows 0..64 (ending where they start) join in front.
        let mut b = vec![d(1064, 50_064, 64), d(9000, 70_000, 8)];
        assert_eq!(joined(&b, 1000, 50_000, 64), Some((0, Join::Before)));
        // Only when both sides end there.
        assert_eq!(joined(&b, 1000, 40_000, 64), None);
        assert_eq!(joined(&b, 900, 50_000, 64), None);
        // A copy in between that writes the new destination blocks it.
        b.push(d(1010, 80_000, 8));
        assert_eq!(joined(&b, 1000, 50_000, 64), None);
        // The merged copy must not overlap itself: destination just before the source.
        let b = vec![d(1064, 1128, 64)];
        assert_eq!(joined(&b, 1000, 1064, 64), None);
    }

    #[test]
    fn a_copy_in_between_that_touches_the_bytes_blocks_the_merge() {
        // Writes the new destination.
        let b = vec![d(1000, 50_000, 64), d(1070, 80_000, 8)];
        assert_eq!(joined(&b, 1064, 50_064, 64), None);
        // Reads the new destination.
        let b = vec![d(1000, 50_000, 64), d(5000, 1100, 8)];
        assert_eq!(joined(&b, 1064, 50_064, 64), None);
        // Writes the new source.
        let b = vec![d(1000, 50_000, 64), d(50_100, 90_000, 8)];
        assert_eq!(joined(&b, 1064, 50_064, 64), None);
        // A signal's copy in between counts as well.
        let b = vec![d(1000, 50_000, 64), sg(1070, 80_000, 8)];
        assert_eq!(joined(&b, 1064, 50_064, 64), None);
    }

    #[test]
    fn data_never_joins_a_signal_copy() {
        // Arena-staged words continuing a signal's words, on both sides: still two copies
        // (merged, the data could land with the signal instead of after the copies before).
        let b = vec![sg(9000, 70_000, 8)];
        assert_eq!(joined(&b, 9008, 70_008, 8), None);
        assert_eq!(joined(&b, 8992, 69_992, 8), None);
        // It may still move ahead of one to join data before it.
        let b = vec![d(1000, 50_000, 64), sg(9000, 70_000, 8)];
        assert_eq!(joined(&b, 1064, 50_064, 64), Some((0, Join::After)));
    }

    #[test]
    fn four_byte_values_below_the_table_are_copied_from_it() {
        let w = |value: u64, count: u32, width| Write {
            peer: 1,
            offset: 4096,
            value,
            width,
            count,
        };
        assert_eq!(
            counted_source(1 << 20, &w(0, 1, WriteWidth::Four)),
            Some(1 << 20)
        );
        assert_eq!(
            counted_source(1 << 20, &w(100, 28, WriteWidth::Four)),
            Some((1 << 20) + 400)
        );
        // The last element is the table's last.
        let last = COUNTING_ELEMS - 5;
        assert!(counted_source(0, &w(last, 5, WriteWidth::Four)).is_some());
        // Past the table, 8-byte elements: staged instead.
        assert_eq!(counted_source(0, &w(last, 6, WriteWidth::Four)), None);
        assert_eq!(counted_source(0, &w(0, 1, WriteWidth::Eight)), None);
        assert_eq!(counted_source(0, &w(u64::MAX, 2, WriteWidth::Four)), None);
        // Two consecutive runs' source indices continue each other on both sides: one copy.
        let (a, b) = (w(0, 16, WriteWidth::Four), w(16, 16, WriteWidth::Four));
        let batch = vec![d(9000, counted_source(5000, &a).unwrap(), 64)];
        let next = d(9064, counted_source(5000, &b).unwrap(), 64);
        assert_eq!(
            joined_copy(&batch, &next, MERGE_WINDOW),
            Some((0, Join::After))
        );
    }

    #[test]
    fn merged_ranges_that_would_overlap_do_not_merge() {
        // Source and destination 64 bytes apart: the merged copy would overlap itself.
        let b = vec![d(1064, 1000, 64)];
        assert_eq!(joined(&b, 1128, 1064, 64), None);
    }

    #[test]
    fn dependent_copies_do_not_share_a_batch() {
        let b = vec![d(1000, 50_000, 64), d(9000, 70_000, 8)];
        // Independent: other bytes everywhere, or only a source shared (reads commute).
        assert!(!depends_on_any(&b, 2000, 60_000, 64));
        assert!(!depends_on_any(&b, 2000, 50_000, 64));
        // Writes what a pending copy writes or reads, or reads what one writes.
        assert!(depends_on_any(&b, 1032, 60_000, 64));
        assert!(depends_on_any(&b, 50_010, 60_000, 8));
        assert!(depends_on_any(&b, 2000, 9004, 8));
        // Touching ends do not overlap.
        assert!(!depends_on_any(&b, 1064, 50_064, 64));
        assert!(!depends_on_any(&[], 0, 0, 8));
    }

    #[test]
    fn signals_merge_only_into_the_last_copy_when_it_holds_signals() {
        // A row, then the flag of that row.
        let b = vec![d(1000, 50_000, 64), sg(9000, 70_000, 8)];
        assert_eq!(signal_continued(&b, 9008, 70_008), Some(1));
        // Not continuing: another word, or another arena place.
        assert_eq!(signal_continued(&b, 9016, 70_008), None);
        assert_eq!(signal_continued(&b, 9008, 70_016), None);
        // The last copy carries data.
        let b = vec![d(9000, 70_000, 8)];
        assert_eq!(signal_continued(&b, 9008, 70_008), None);
        // A copy after the signal copy: merging would land the new signal before it.
        let b = vec![sg(9000, 70_000, 8), d(1000, 50_000, 64)];
        assert_eq!(signal_continued(&b, 9008, 70_008), None);
        assert_eq!(signal_continued(&[], 9008, 70_008), None);
    }

    #[test]
    fn the_window_is_bounded() {
        let mut b = vec![d(1000, 50_000, 64)];
        for k in 0..MERGE_WINDOW as u64 {
            b.push(d(100_000 + 16 * k, 200_000 + 16 * k, 8));
        }
        assert_eq!(joined(&b, 1064, 50_064, 64), None);
        // The compaction pass looks further back.
        b.push(d(1064, 50_064, 64));
        compact(&mut b, COMPACT_WINDOW);
        assert_eq!(b.len(), MERGE_WINDOW + 1);
        assert_eq!(b[0], d(1000, 50_000, 128));
    }

    /// Runs of four warps, each `rows` (row, weights, flag) as a combine sends them, arriving
    /// in the order `order`: what the push-time merge leaves, and what the compaction leaves.
    fn combine_runs(order: &[u64], flags: fn(u64, u64, usize) -> Pending) -> (usize, Vec<Pending>) {
        const ROW: u64 = 1024;
        let mut b: Vec<Pending> = Vec::new();
        let mut push = |c: Pending| {
            if !merged_into(&mut b, &c, MERGE_WINDOW) {
                b.push(c);
            }
        };
        for (a, &w) in order.iter().enumerate() {
            let rows = 16;
            push(d(
                1_000_000 + w * rows * 32,
                5_000_000 + w * rows * 32,
                (rows * 32) as usize,
            ));
            push(d(
                2_000_000 + w * rows * ROW,
                6_000_000 + w * rows * ROW,
                (rows * ROW) as usize,
            ));
            // Flags of the run staged in the arena in arrival order.
            push(flags(
                3_000_000 + w * rows * 8,
                7_000_000 + a as u64 * rows * 8,
                (rows * 8) as usize,
            ));
        }
        let pushed = b.len();
        compact(&mut b, COMPACT_WINDOW);
        (pushed, b)
    }

    #[test]
    fn compaction_merges_what_earlier_merges_made_adjacent() {
        // In order, everything merges at push time: weights and rows join the first run's
        // (ahead of its flags), so the flags copy is last again when the next flags continue it.
        let (pushed, b) = combine_runs(&[0, 1, 2, 3], sg);
        assert_eq!(pushed, 3);
        assert_eq!(b.len(), 3, "{b:?}");
        // Out of order: run 2 first, then 0, then 3 (continues 2), then 1 (between 0 and 2).
        let (pushed, b) = combine_runs(&[2, 0, 3, 1], sg);
        assert!(
            pushed > b.len(),
            "{pushed} pushed, {} after: {b:?}",
            b.len()
        );
        let data: Vec<_> = b.iter().filter(|c| !c.signal).collect();
        assert_eq!(data.len(), 2, "weights and rows, one copy each: {b:?}");
        assert_eq!(data[0], &d(1_000_000, 5_000_000, 4 * 16 * 32));
        assert_eq!(data[1], &d(2_000_000, 6_000_000, 4 * 16 * 1024));
        // Every signal stays after the data copies that came before it in arrival order.
        // (Both data copies hold data from before some flags: they must come first.)
        assert!(b[..2].iter().all(|c| !c.signal), "{b:?}");
        assert_eq!(
            b.iter()
                .filter(|c| c.signal)
                .map(|c| c.bytes)
                .sum::<usize>(),
            4 * 16 * 8
        );
    }

    #[test]
    fn set_flags_of_one_value_become_one_copy_whatever_the_arrival_order() {
        let epoch = |dst, src, bytes| set(dst, src, bytes, 7);
        for order in [[0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0]] {
            let (_, b) = combine_runs(&order, epoch);
            assert_eq!(b.len(), 3, "{order:?}: {b:?}");
            // Data first, then the flags of every run as one copy from the staged stretch.
            assert!(!b[0].signal && !b[1].signal);
            assert_eq!(b[2], set(3_000_000, 7_000_000, 4 * 16 * 8, 7), "{order:?}");
        }
    }

    #[test]
    fn only_set_copies_of_one_value_over_one_staged_stretch_are_regrouped() {
        // Out of order, one value, one stretch: merged.
        let mut b = vec![
            set(1016, 508, 8, 3),
            set(1000, 500, 8, 3),
            set(1008, 516, 8, 3),
        ];
        regroup_fills(&mut b);
        assert_eq!(b, vec![set(1000, 500, 24, 3)]);
        // Two values: two groups, each left as it is (nothing touches within a group).
        let mut b = vec![set(1016, 500, 8, 3), set(1000, 508, 8, 4)];
        let before = b.clone();
        regroup_fills(&mut b);
        assert_eq!(b, before);
        // A gap in the staged bytes (something else staged between): left alone.
        let mut b = vec![set(1008, 500, 8, 3), set(1000, 516, 8, 3)];
        let before = b.clone();
        regroup_fills(&mut b);
        assert_eq!(b, before);
        // Overlapping destinations (one word set twice): left alone.
        let mut b = vec![set(1000, 500, 16, 3), set(1008, 516, 8, 3)];
        let before = b.clone();
        regroup_fills(&mut b);
        assert_eq!(b, before);
        // An add (no fill) or data between splits the groups; each keeps its place.
        let mut b = vec![
            set(1008, 500, 8, 3),
            sg(2000, 508, 8),
            set(1000, 516, 8, 3),
            d(5000, 9000, 64),
            set(1024, 524, 8, 3),
            set(1016, 532, 8, 3),
        ];
        regroup_fills(&mut b);
        assert_eq!(
            b,
            vec![
                set(1008, 500, 8, 3),
                sg(2000, 508, 8),
                set(1000, 516, 8, 3),
                d(5000, 9000, 64),
                set(1016, 524, 16, 3),
            ]
        );
        // Words merged at push time from different values lose their fill.
        let mut a = set(1000, 500, 8, 3);
        a.extend_signal(&set(1008, 508, 8, 4));
        assert_eq!(a.fill, None);
    }

    /// Random mixes of data copies (continuing, random, staged, overlapping) and signal copies
    /// (sets of two values, adds), pushed by the executor's rules and issued in batches
    /// (compacted), leave memory exactly as the copies one by one in ring order do; with
    /// batched copies also when every batch runs backwards, and no batch holds two copies
    /// that touch the same bytes.
    #[test]
    fn merged_batches_leave_memory_as_the_copies_in_order() {
        let mut rand = xorshift(0x9E37_79B9_7F4A_7C15u64);
        let run = |mem: &mut Vec<u8>, c: &Pending| {
            let (d, s, n) = (c.dst as usize, c.src as usize, c.bytes);
            let bytes = mem[s..s + n].to_vec();
            mem[d..d + n].copy_from_slice(&bytes);
        };
        for case in 0..3000 {
            let mut mem = vec![0u8; 1 << 18];
            for b in mem[100_000..110_000].iter_mut() {
                *b = rand(256) as u8;
            }
            let batched = case % 2 == 0;
            let max = [4, 16, 1024][rand(3) as usize];
            let (mut batch, mut issued): (Vec<Pending>, Vec<Vec<Pending>>) = (vec![], vec![]);
            let issue = |batch: &mut Vec<Pending>, issued: &mut Vec<Vec<Pending>>| {
                if !batch.is_empty() {
                    compact(batch, COMPACT_WINDOW);
                    issued.push(std::mem::take(batch));
                }
            };
            let (mut arena, mut cursor, span) =
                (200_000u64, 0u64, [16u64, 64, 256][rand(3) as usize]);
            let mut ops = vec![];
            for _ in 0..1 + rand(100) {
                let c = if rand(10) < 6 {
                    let slot = if rand(3) == 0 {
                        rand(span)
                    } else {
                        cursor = (cursor + 1 + rand(2)) % span;
                        cursor
                    };
                    let (dst, bytes) = (8 * slot, 8 * (1 + rand(3)));
                    let src = match rand(6) {
                        0 => {
                            let at = arena;
                            arena += bytes;
                            for k in at..at + bytes {
                                mem[k as usize] = rand(256) as u8;
                            }
                            at
                        }
                        1 => 8 * rand(span + 8),
                        _ => 100_000 + dst,
                    };
                    if src < dst + bytes && dst < src + bytes {
                        continue;
                    }
                    d(dst, src, bytes as usize)
                } else {
                    let words = 1 + rand(2);
                    let set_value = (rand(4) != 0).then(|| 1 + rand(2));
                    let value = set_value.unwrap_or(1000 + rand(1000));
                    arena += 8 * rand(2); // sometimes other staging between
                    let at = arena;
                    for w in 0..words {
                        let k = (at + 8 * w) as usize;
                        mem[k..k + 8].copy_from_slice(&value.to_le_bytes());
                    }
                    arena += 8 * words;
                    let dst = 4096 + 8 * rand(24);
                    Pending::signal(dst, at, 8 * words as usize, 0, set_value)
                };
                ops.push(c);
                // As `push_copy` and `push_signal_copy` do.
                if batched && !c.signal && depends_on_any(&batch, c.dst, c.src, c.bytes) {
                    issue(&mut batch, &mut issued);
                }
                if merged_into(&mut batch, &c, MERGE_WINDOW) {
                    continue;
                }
                if batched && c.signal {
                    issue(&mut batch, &mut issued);
                }
                batch.push(c);
                if batch.len() >= max || rand(8) == 0 {
                    issue(&mut batch, &mut issued);
                }
            }
            issue(&mut batch, &mut issued);
            let mut expected = mem.clone();
            ops.iter().for_each(|c| run(&mut expected, c));
            let mut got = mem.clone();
            issued.iter().flatten().for_each(|c| run(&mut got, c));
            assert!(got == expected, "case {case}: {ops:?} issued as {issued:?}");
            // Over several streams: each batch's lead copies first, in an order no stream
            // would keep (backwards), then the rest in order on stream 0.
            let mut striped = mem.clone();
            for b in &issued {
                match stripes(b, 3, 1) {
                    Some(Stripes { lead, rest }) => {
                        lead.iter()
                            .rev()
                            .for_each(|&(k, _)| run(&mut striped, &b[k]));
                        rest.iter().for_each(|&k| run(&mut striped, &b[k]));
                    }
                    None => b.iter().for_each(|c| run(&mut striped, c)),
                }
            }
            assert!(
                striped == expected,
                "case {case}: {ops:?} striped from {issued:?}"
            );
            if batched {
                let mut backwards = mem.clone();
                for b in &issued {
                    b.iter().rev().for_each(|c| run(&mut backwards, c));
                    for (x, c) in b.iter().enumerate() {
                        assert!(
                            !b[x + 1..].iter().any(|e| touches(c, e.dst, e.src, e.bytes)),
                            "case {case}: dependent copies in one batch {b:?}"
                        );
                    }
                }
                assert!(
                    backwards == expected,
                    "case {case}: {ops:?} issued as {issued:?}"
                );
            }
        }
    }

    #[test]
    fn stripes_lead_with_large_independent_copies_balanced_over_the_streams() {
        // Four independent row copies (sizes 4, 3, 2, 1 units), a small one, a signal, and two
        // copies of shared bytes.
        const U: usize = 1 << 20;
        let b = vec![
            d(0, 100 << 20, 2 * U),
            d(10 << 20, 110 << 20, 4 * U),
            sg(90 << 20, 200 << 20, 8),
            d(20 << 20, 120 << 20, U),
            d(30 << 20, 130 << 20, 3 * U),
            d(40 << 20, 140 << 20, 16),
            d(50 << 20, 150 << 20, U),
            d(50 << 20, 160 << 20, U),
        ];
        let Stripes { lead, rest } = stripes(&b, 2, 64 << 10).unwrap();
        // Largest first, each to the lighter stream: 4 -> 0, 3 -> 1, 2 -> 1, 1 -> 0.
        assert_eq!(lead, vec![(1, 0), (4, 1), (0, 1), (3, 0)]);
        // The signal, the small copy and the two copies of shared bytes stay, in order.
        assert_eq!(rest, vec![2, 5, 6, 7]);
        let mut all: Vec<usize> = lead.iter().map(|&(k, _)| k).chain(rest).collect();
        all.sort_unstable();
        assert_eq!(all, (0..b.len()).collect::<Vec<_>>(), "each copy once");
        // One stream, or fewer than two leading copies: the batch goes out as it is.
        assert!(stripes(&b, 1, 64 << 10).is_none());
        assert!(stripes(&b, 4, 4 * U).is_none(), "one copy of 4 units leads");
        assert!(stripes(&b[..1], 4, 1).is_none());
    }

    #[test]
    fn compaction_keeps_each_signal_behind_the_copies_before_it() {
        // data A, signal S, data B that overlaps A's destination: B cannot move ahead of S's
        // predecessor (it touches A), so the order A, S, B stays.
        let mut b = vec![
            d(1000, 50_000, 64),
            sg(9000, 70_000, 8),
            d(1032, 60_000, 64),
        ];
        let before = b.clone();
        compact(&mut b, COMPACT_WINDOW);
        assert_eq!(b, before);
        // Two signals with data between that moves ahead: the signals then merge, still after
        // every data copy.
        let mut b = vec![
            d(1000, 50_000, 64),
            sg(9000, 70_000, 8),
            d(1064, 50_064, 64),
            sg(9008, 70_008, 8),
        ];
        compact(&mut b, COMPACT_WINDOW);
        assert_eq!(b, vec![d(1000, 50_000, 128), sg(9000, 70_000, 16)]);
    }

    /// A whole dispatch as the kernels send it to one peer: 64 warps, each with one run of
    /// its chunk of consecutive tokens (rows, scales, top-k ids, weights, and the source
    /// indices from the counting table), the runs reaching the executor in a shuffled warp
    /// order. Pushed and compacted as the executor does, all of them in one batch become one
    /// copy per record; split over batches of a few runs each (a hand-over at every poll),
    /// only the runs that meet in a batch merge.
    #[test]
    fn a_dispatch_held_in_one_batch_merges_into_one_copy_per_record() {
        let mut rand = xorshift(0x2545_F491_4F6C_DD1Du64);
        // Per record: (source base, destination base, bytes per token).
        let records: [(u64, u64, u64); 5] = [
            (1 << 40, 1 << 44, 7168),   // FP8 rows
            (2 << 40, 2 << 44, 56 * 4), // scales
            (3 << 40, 3 << 44, 8 * 8),  // top-k ids
            (4 << 40, 4 << 44, 8 * 4),  // top-k weights
            (5 << 40, 5 << 44, 4),      // source indices (counting table)
        ];
        let (warps, chunk) = (64u64, 64u64);
        let mut order: Vec<u64> = (0..warps).collect();
        for k in (1..order.len()).rev() {
            order.swap(k, rand(k as u64 + 1) as usize);
        }
        let copies_of = |runs_per_batch: usize| -> usize {
            let mut out = 0;
            for group in order.chunks(runs_per_batch) {
                let mut batch: Vec<Pending> = vec![];
                for &w in group {
                    for &(src, dst, per) in &records {
                        let c = d(
                            dst + w * chunk * per,
                            src + w * chunk * per,
                            (chunk * per) as usize,
                        );
                        if !merged_into(&mut batch, &c, MERGE_WINDOW) {
                            batch.push(c);
                        }
                    }
                }
                compact(&mut batch, COMPACT_WINDOW);
                out += batch.len();
            }
            out
        };
        assert_eq!(
            copies_of(64),
            records.len(),
            "every run held together: one copy per record"
        );
        // Four runs a batch: only neighbours that meet merge (at most 5 * 64 copies).
        let few = copies_of(4);
        assert!(few > 4 * records.len() && few <= 5 * 64, "{few}");
    }
}
