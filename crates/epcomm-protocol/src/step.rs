//! Stable names of the protocol steps.
//!
//! The CUDA kernels cite these labels (`// [E3] compute offsets`), `docs/protocol.md` explains
//! them, and every [`crate::Violation`] names the step at which it was detected. The labels are a
//! public contract: never renumber them, only add new ones.

use std::fmt;

/// One labelled step of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    /// `[R]` op start: re-validate the live output of the last dispatch before the op begins.
    Recheck,
    /// `[E1]` write my row of counts, tagged with the notify epoch `n`, into
    /// `count_matrix[n%2][me][*]` of every rank (relaxed: each word carries its value and tag).
    E1,
    /// `[E2]` wait until every `count_matrix[n%2][s][*]` word of my buffer carries tag `n`
    /// (acquire, bounded).
    E2,
    /// `[E3]` compute offsets: my rows in rank `d` start at `sum_{s<me} count(s->d)`.
    E3,
    /// `[E4]` write data into `recv[e%2]` of each destination at offset + slot (relaxed).
    E4,
    /// `[E5]` increment `done[me]` on every rank, once per sender block, after its data (release).
    E5,
    /// `[E6]` wait until `done[s] >= expected` for every source `s` (acquire, bounded).
    E6,
    /// `[E7]` read the output: `count_matrix[n%2][s][me]` (tag must be `n`) and `recv[e%2]`.
    E7,
    /// `[C1]` write contributions: each row into the owner's `comb[c%2][me][token]` (relaxed),
    /// then the owner's per-token flag `flags[me][token] := c` (release).
    C1,
    /// `[C2]` increment `done[me]` on every rank, once per sender block, after the block's
    /// reductions (release).
    C2,
    /// `[C3]` wait until `flags[s][token] >= c` for exactly the ranks `s` that hold a
    /// contribution to the token (acquire, bounded).
    C3,
    /// `[C4]` reduce: `comb[c%2][s][token]` for `s != me`, local data for `s == me`.
    C4,
    /// `[C5]` wait until `done[s] >= expected` for every source `s` (acquire, bounded).
    C5,
    /// `[F1]` prologue: exit before writing anything if this rank failed earlier (its failure
    /// claim) or a peer published the abort word.
    F1,
    /// `[F2]` on failure: publish the abort word to every peer.
    F2,
    /// `[G1]` Global schedule: round-aware barrier before the op touches shared state.
    G1,
    /// `[G2]` Global schedule: write my row of counts into `count_matrix[n%2]` (relaxed). In a
    /// low-latency op: the round-aware barrier that starts the receive phase.
    G2,
    /// `[G3]` Global schedule: barrier, every rank's counts have landed.
    G3,
    /// `[G4]` Global schedule: read the counts of `count_matrix[n%2]` (acquire; tag must be `n`).
    G4,
    /// `[G5]` Global schedule: barrier before any data is written (DeepEP: cleaning finished).
    G5,
    /// `[L1]` low-latency send phase: build the routing masks of the whole batch locally (no
    /// cross-block or cross-rank exchange).
    L1,
    /// `[L2]` low-latency send phase, block 0: store `(l << 32) | rows` into every rank's
    /// `ll_counts[l%2][me]` (relaxed).
    L2,
    /// `[L3]` low-latency send phase: each token's row into `ll_x[l%2][me][j]` of every rank
    /// it goes to, `j` its index among my tokens for that rank (relaxed).
    L3,
    /// `[L4]` low-latency send phase: increment `done[me]` on every rank, once per sender
    /// block, after its rows (release).
    L4,
    /// `[L5]` low-latency receive phase: wait until `done[s] >= expected` for every source `s`
    /// (acquire, bounded).
    L5,
    /// `[L6]` low-latency receive phase: read `ll_counts[l%2][s]` (tag must be `l`), the first
    /// packed row of each source.
    L6,
    /// `[L7]` low-latency receive phase: copy the received rows `ll_x[l%2][s][0..rows]` into
    /// the packed output.
    L7,
    /// `[L8]` low-latency combine send phase: each packed row to its source's
    /// `ll_comb[l'%2][token][k]` (relaxed), then `[L4]`.
    L8,
    /// `[L9]` low-latency combine receive phase: after `[L5]`, per token the sum of
    /// `ll_comb[l'%2][token][k]` over its valid `k` in increasing `k`.
    L9,
    /// `[I1]` internode op start: store `credit[me] := i - 1` (release) into every rank that writes my internode regions (my node's ranks and my rail peers, myself included): I read nothing of op `i - 1` any more.
    I1,
    /// `[I2]` (non-cached) into each rail peer `(k, l)`, `k != n`: `rail_count[m%2][n][j] := (m << 32) | count(me -> (k, j))` for `j < L`, and `[L]` the number of my tokens that cross to node `k` (relaxed).
    I2,
    /// `[I3]` (non-cached) into each rank `d` of my node: `xcount[m%2][me] := (m << 32) | count(me -> d)` (relaxed).
    I3,
    /// `[I4]` (non-cached) per node `k != n`: wait until every `rail_count[m%2][k][*]` word carries tag `m` (acquire, bounded), then relay `count((k, l) -> d)` as `xcount[m%2][(k, l)]`, tagged `m`, into each rank `d` of my node (relaxed).
    I4,
    /// `[I5]` before writing rows of op `i` into a peer (rail peer or local rank, directly or forwarded): wait until its `credit >= i - 2` (acquire, bounded).
    I5,
    /// `[I6]` my rows: one copy per destination node `k != n` into rail peer `rail_buf[i%2][n][r]` (`r` its index among my tokens crossing to `k`), and into each rank `d` of my node `xrecv[i%2][me][j]` (`j` its index among my tokens for `d`) (relaxed).
    I6,
    /// `[I7]` after my rows: `rail_done[n] := i` on each rail peer I sent rows to, `idone[me] := i` on each rank of my node I sent rows to (release).
    I7,
    /// `[I8]` per node `k != n` whose rail peer sends me rows: wait until `rail_done[k] >= i` (acquire, bounded).
    I8,
    /// `[I9]` each row of `rail_buf[i%2][k]` into `xrecv[i%2][(k, l)][j]` of each rank of my node it goes to (relaxed), then `idone[(k, l)] := i` on each of them (release).
    I9,
    /// `[I10]` (non-cached) wait until every `xcount[m%2][s]` word carries tag `m` (acquire, bounded): the receive sizes, computed on the device.
    I10,
    /// `[I11]` wait until `idone[s] >= i` (acquire, bounded) for exactly the sources `s` with `count(s -> me) > 0`.
    I11,
    /// `[I12]` read the output: (non-cached) re-read `xcount[m%2][s]` (tag must be `m`), then `xrecv[i%2][s][0..count(s -> me)]`, by source then token.
    I12,
    /// `[I6c]` chunked forwarding ([`crate::ModelConfig::with_rail_ring`]), sender, chunk `g` (the `g`-th since setup) to the rail peer in node `k`: wait until `ring_credit[k] >= g + 1 - R` (acquire, bounded), write its rows into the peer's `ring[n][g % R]` (relaxed), then `chunks_in[n] := g + 1` on the peer (release). Replaces the rail half of `[I6]`/`[I7]`.
    I6c,
    /// `[I8c]` chunked forwarding, forwarder, chunk `g` of node `k`: wait until `chunks_in[k] >= g + 1` (acquire, bounded). Replaces `[I8]`.
    I8c,
    /// `[I9c]` chunked forwarding, forwarder: each row of `ring[k][g % R]` into `xrecv[i%2][(k, l)][j]` of each rank of my node it goes to (relaxed), then `ring_credit[n] := g + 1` on the sender (release); after the last chunk of `k` in op `i`, `idone[(k, l)] := i` on each rank it sent rows to (release). Replaces `[I9]`.
    I9c,
    /// `[J6c]` streamed partials ([`crate::ModelConfig::with_rail_ring`]), forwarder, chunk `g` of partials for the source `(k, l)`: wait until `pring_credit[k] >= g + 1 - R` (acquire, bounded), write the partials (reduced as in `[J6]`) into the source's `pring[n][g % R]` (relaxed), then `pchunks_in[n] := g + 1` on it (release). Replaces `[J6]`/`[J7]`.
    J6c,
    /// `[J8c]` streamed partials, source, chunk `g` of node `k`: wait until `pchunks_in[k] >= g + 1` (acquire, bounded). Replaces `[J8]`'s partial wait.
    J8c,
    /// `[J9c]` streamed partials, source: take each partial of `pring[k][g % R]` for its token (the reduction of `[J9]` adds it), then `pring_credit[n] := g + 1` on the forwarder (release).
    J9c,
    /// `[J1]` internode combine start: store `ccredit[me] := q - 1` (release) into every rank that writes my combine regions (my node's ranks and my rail peers): I read nothing of internode combine `q - 1` any more.
    J1,
    /// `[J2]` before writing contributions or partials of combine `q` into a peer: wait until its `ccredit >= q - 2` (acquire, bounded).
    J2,
    /// `[J3]` each row of my live internode output, as its contribution: for a source `s` of my node into `s.cdirect[q%2][me][t]`, for a source `(k, ls)` of another node into its forwarder `(n, ls).cfwd[q%2][s][t][l]` (relaxed); my own stay local.
    J3,
    /// `[J4]` after my contributions: `cdone[me] := q` (release) on each rank of my node I wrote contributions into.
    J4,
    /// `[J5]` forwarder, per node `k != n` whose rail peer `(k, l)` has tokens crossing to my node: wait until `cdone[j] >= q` (acquire, bounded) for every other rank `j` of my node that holds a row of `(k, l)`.
    J5,
    /// `[J6]` forwarder: per token `t` of `(k, l)` crossing to my node, reduce its node-local contributions (`cfwd[q%2][(k, l)][t][*]` and my own) into one partial, and write it into `(k, l).cpart[q%2][n][t]` over the rail (relaxed).
    J6,
    /// `[J7]` forwarder: after the partials, `cpdone[n] := q` (release) on the source `(k, l)`.
    J7,
    /// `[J8]` source: wait until `cdone[d] >= q` for every other rank `d` of my node my tokens went to, and `cpdone[k] >= q` for every node `k != n` some token of mine crossed to (acquire, bounded).
    J8,
    /// `[J9]` source: per token, reduce my own contribution, `cdirect[q%2][d][t]` of my node's ranks and `cpart[q%2][k][t]` of the other nodes.
    J9,
    /// `[A1]` op start, after `[F1]`: store my intent word `(a << 32) | kind` for agreed op `a`
    /// into `intent[a%2][me]` of every peer (relaxed: the word carries its tag).
    A1,
    /// `[A2]` after the op's final wait (`[E6]`, `[C5]`, `[L5]`): wait until every peer's
    /// `intent[a%2][s]` carries tag `a` (bounded) and compare it with mine.
    A2,
}

impl Step {
    /// Every step, in label order.
    pub const ALL: [Step; 58] = [
        Step::Recheck,
        Step::E1,
        Step::E2,
        Step::E3,
        Step::E4,
        Step::E5,
        Step::E6,
        Step::E7,
        Step::C1,
        Step::C2,
        Step::C3,
        Step::C4,
        Step::C5,
        Step::F1,
        Step::F2,
        Step::G1,
        Step::G2,
        Step::G3,
        Step::G4,
        Step::G5,
        Step::L1,
        Step::L2,
        Step::L3,
        Step::L4,
        Step::L5,
        Step::L6,
        Step::L7,
        Step::L8,
        Step::L9,
        Step::I1,
        Step::I2,
        Step::I3,
        Step::I4,
        Step::I5,
        Step::I6,
        Step::I7,
        Step::I8,
        Step::I9,
        Step::I10,
        Step::I11,
        Step::I12,
        Step::I6c,
        Step::I8c,
        Step::I9c,
        Step::J6c,
        Step::J8c,
        Step::J9c,
        Step::J1,
        Step::J2,
        Step::J3,
        Step::J4,
        Step::J5,
        Step::J6,
        Step::J7,
        Step::J8,
        Step::J9,
        Step::A1,
        Step::A2,
    ];

    /// The bracketed label the CUDA code cites, e.g. `"[E3]"`.
    pub fn label(self) -> &'static str {
        match self {
            Step::Recheck => "[R]",
            Step::E1 => "[E1]",
            Step::E2 => "[E2]",
            Step::E3 => "[E3]",
            Step::E4 => "[E4]",
            Step::E5 => "[E5]",
            Step::E6 => "[E6]",
            Step::E7 => "[E7]",
            Step::C1 => "[C1]",
            Step::C2 => "[C2]",
            Step::C3 => "[C3]",
            Step::C4 => "[C4]",
            Step::C5 => "[C5]",
            Step::F1 => "[F1]",
            Step::F2 => "[F2]",
            Step::G1 => "[G1]",
            Step::G2 => "[G2]",
            Step::G3 => "[G3]",
            Step::G4 => "[G4]",
            Step::G5 => "[G5]",
            Step::L1 => "[L1]",
            Step::L2 => "[L2]",
            Step::L3 => "[L3]",
            Step::L4 => "[L4]",
            Step::L5 => "[L5]",
            Step::L6 => "[L6]",
            Step::L7 => "[L7]",
            Step::L8 => "[L8]",
            Step::L9 => "[L9]",
            Step::I1 => "[I1]",
            Step::I2 => "[I2]",
            Step::I3 => "[I3]",
            Step::I4 => "[I4]",
            Step::I5 => "[I5]",
            Step::I6 => "[I6]",
            Step::I7 => "[I7]",
            Step::I8 => "[I8]",
            Step::I9 => "[I9]",
            Step::I10 => "[I10]",
            Step::I11 => "[I11]",
            Step::I12 => "[I12]",
            Step::I6c => "[I6c]",
            Step::I8c => "[I8c]",
            Step::I9c => "[I9c]",
            Step::J6c => "[J6c]",
            Step::J8c => "[J8c]",
            Step::J9c => "[J9c]",
            Step::J1 => "[J1]",
            Step::J2 => "[J2]",
            Step::J3 => "[J3]",
            Step::J4 => "[J4]",
            Step::J5 => "[J5]",
            Step::J6 => "[J6]",
            Step::J7 => "[J7]",
            Step::J8 => "[J8]",
            Step::J9 => "[J9]",
            Step::A1 => "[A1]",
            Step::A2 => "[A2]",
        }
    }

    /// A short description of what the step does.
    pub fn summary(self) -> &'static str {
        match self {
            Step::Recheck => "recheck live dispatch output",
            Step::E1 => "write count row",
            Step::E2 => "wait count rows",
            Step::E3 => "compute offsets",
            Step::E4 => "write data",
            Step::E5 => "signal done",
            Step::E6 => "wait done",
            Step::E7 => "read output",
            Step::C1 => "write contributions",
            Step::C2 => "signal done",
            Step::C3 => "wait token flags",
            Step::C4 => "reduce",
            Step::C5 => "wait all done",
            Step::F1 => "check failure",
            Step::F2 => "publish abort",
            Step::G1 => "barrier before op",
            Step::G2 => "write count row (LL: barrier before receive)",
            Step::G3 => "barrier after counts",
            Step::G4 => "read counts",
            Step::G5 => "barrier before data",
            Step::L1 => "routing masks",
            Step::L2 => "write counts",
            Step::L3 => "write rows",
            Step::L4 => "signal done",
            Step::L5 => "wait done",
            Step::L6 => "first rows",
            Step::L7 => "pack",
            Step::L8 => "combine rows",
            Step::L9 => "reduce",
            Step::I1 => "release credit",
            Step::I2 => "write rail counts",
            Step::I3 => "write local counts",
            Step::I4 => "wait and relay rail counts",
            Step::I5 => "wait credit",
            Step::I6 => "write rows",
            Step::I7 => "signal rows",
            Step::I8 => "wait rail rows",
            Step::I9 => "forward rows",
            Step::I10 => "wait receive counts",
            Step::I11 => "wait done",
            Step::I12 => "read output",
            Step::I6c => "send a chunk",
            Step::I8c => "wait a chunk",
            Step::I9c => "forward a chunk",
            Step::J6c => "send a chunk of partials",
            Step::J8c => "wait a chunk of partials",
            Step::J9c => "take a chunk of partials",
            Step::J1 => "release combine credit",
            Step::J2 => "wait combine credit",
            Step::J3 => "write contributions",
            Step::J4 => "signal contributions",
            Step::J5 => "wait local contributions",
            Step::J6 => "reduce and send partials",
            Step::J7 => "signal partials",
            Step::J8 => "wait contributions and partials",
            Step::J9 => "reduce",
            Step::A1 => "publish intent",
            Step::A2 => "check intent",
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.label(), self.summary())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn labels_are_unique_and_bracketed() {
        let labels: HashSet<_> = Step::ALL.iter().map(|s| s.label()).collect();
        assert_eq!(labels.len(), Step::ALL.len());
        for s in Step::ALL {
            let l = s.label();
            assert!(l.starts_with('[') && l.ends_with(']'), "{l}");
        }
    }

    #[test]
    fn display_names_label_and_summary() {
        assert_eq!(Step::E3.to_string(), "[E3] compute offsets");
        assert_eq!(Step::G5.to_string(), "[G5] barrier before data");
        assert_eq!(Step::C5.to_string(), "[C5] wait all done");
        assert_eq!(Step::L6.to_string(), "[L6] first rows");
    }
}
