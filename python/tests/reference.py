"""A plain-torch reference of dispatch and combine, written from epcomm's ordering contract
(crates/epcomm/src/lib.rs, crates/epcomm-reference): what every rank must receive, bit for bit.

* Rank ``r`` holds experts ``[r * epr, (r + 1) * epr)``. It receives each token that names at
  least one of them exactly once, rows ordered by source rank, then source token index.
* ``recv_topk_idx``: the local id (``e - r * epr``) where the expert is on ``r``, ``-1``
  elsewhere; ``recv_topk_weights``: the weight there, ``0`` elsewhere. Per local expert: how
  many rows name it.
* Combine: token ``t`` of rank ``s`` is ``sum over r (in increasing r) of y_r[row of (s, t)]``,
  accumulated in fp32 from 0 and rounded to bf16 once; top-k weights the same way in fp32.

Inputs are generated per rank from a seed with a CPU generator, so every process can compute
every rank's inputs, and so the reference of any rank.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch

FP8_MAX = 448.0


@dataclass
class RankInputs:
    """One rank's tokens: bf16 ``x``, e4m3 ``x_fp8`` with f32 ``scales`` (when hidden % 128
    == 0), int64 ``topk_idx`` (-1 = none) and f32 ``topk_weights``."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    x_fp8: Optional[torch.Tensor] = None
    scales: Optional[torch.Tensor] = None


def quantize_fp8(x):
    """Per-128-channel e4m3 quantization: ``scale = max(amax, 1e-4) / 448``."""
    t, h = x.shape
    groups = x.float().view(t, h // 128, 128)
    amax = groups.abs().amax(dim=-1).clamp(min=1e-4)
    scales = (amax / FP8_MAX).contiguous()
    q = (groups / scales.unsqueeze(-1)).view(t, h).to(torch.float8_e4m3fn)
    return q, scales


def make_inputs(rank, tokens, hidden, top_k, experts, world, seed, mask=0.0, skew_to=None):
    """Rank `rank`'s inputs: x ~ N(0, 1) in bf16; top-k of ``|randn| + 1`` scores (DeepEP's
    routing), or (`skew_to`) top-k experts all of rank `skew_to`; each id replaced by -1 with
    probability `mask`; weights ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    epr = experts // world
    if skew_to is None:
        scores = torch.randn(tokens, experts, generator=g).abs() + 1
        idx = scores.topk(top_k, dim=1).indices
    else:
        scores = torch.rand(tokens, epr, generator=g)
        idx = scores.topk(top_k, dim=1).indices + skew_to * epr
    idx = idx.to(torch.int64)
    if mask > 0:
        drop = torch.rand(tokens, top_k, generator=g) < mask
        idx = idx.masked_fill(drop, -1)
    w = torch.randn(tokens, top_k, generator=g)
    inputs = RankInputs(x.contiguous(), idx.contiguous(), w.contiguous())
    if hidden % 128 == 0 and tokens > 0:
        inputs.x_fp8, inputs.scales = quantize_fp8(x)
    elif hidden % 128 == 0:
        inputs.x_fp8 = torch.empty((0, hidden), dtype=torch.float8_e4m3fn)
        inputs.scales = torch.empty((0, hidden // 128), dtype=torch.float32)
    return inputs


@dataclass
class Received:
    """What rank `r` receives: rows (bf16, or e4m3 and scales), local ids, weights, the source
    of every row, and rows per local expert."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    per_expert: List[int]
    x_fp8: Optional[torch.Tensor] = None
    scales: Optional[torch.Tensor] = None


def layout(topk_idx, experts, world):
    """``(tokens per rank, tokens per expert, is_token_in_rank)`` of one rank's ids."""
    epr = experts // world
    valid = topk_idx >= 0
    per_expert = torch.bincount(topk_idx[valid], minlength=experts)
    in_rank = torch.zeros((topk_idx.shape[0], world), dtype=torch.bool)
    for r in range(world):
        in_rank[:, r] = ((topk_idx >= r * epr) & (topk_idx < (r + 1) * epr)).any(dim=1)
    return in_rank.sum(0).to(torch.int32), per_expert.to(torch.int32), in_rank


def dispatch(all_inputs, r, experts):
    """What rank `r` receives from every rank's inputs (``all_inputs[s]`` is rank s's)."""
    world = len(all_inputs)
    epr = experts // world
    lo, hi = r * epr, (r + 1) * epr
    xs, x8s, scs, ids, ws, srcs, toks = [], [], [], [], [], [], []
    for s, inp in enumerate(all_inputs):
        local = (inp.topk_idx >= lo) & (inp.topk_idx < hi)
        sel = local.any(dim=1)
        xs.append(inp.x[sel])
        if inp.x_fp8 is not None:
            x8s.append(inp.x_fp8[sel])
            scs.append(inp.scales[sel])
        ids.append(torch.where(local, inp.topk_idx - lo, torch.full_like(inp.topk_idx, -1))[sel])
        ws.append(torch.where(local, inp.topk_weights, torch.zeros_like(inp.topk_weights))[sel])
        srcs.append(torch.full((int(sel.sum()),), s, dtype=torch.int64))
        toks.append(torch.nonzero(sel).flatten())
    topk_idx = torch.cat(ids)
    per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=epr).tolist()
    return Received(
        x=torch.cat(xs),
        topk_idx=topk_idx,
        topk_weights=torch.cat(ws),
        src_rank=torch.cat(srcs),
        src_token=torch.cat(toks),
        per_expert=per_expert,
        x_fp8=torch.cat(x8s) if x8s else None,
        scales=torch.cat(scs) if scs else None,
    )


def expert_output(recv_x, r):
    """The expert output the tests make rank `r` produce from its received rows:
    ``bf16(f32(x) * (r + 1))`` (the same on the GPU and here)."""
    return (recv_x.float() * (r + 1)).to(torch.bfloat16)


def combine(received, ys, y_weights, s, num_tokens, hidden, top_k):
    """Rank `s`'s combined tokens from every rank's rows ``ys[r]`` (and weights): fp32 sums in
    rank order, rounded to bf16 once. Returns ``(x, weights or None)``."""
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32)
    wacc = torch.zeros((num_tokens, top_k), dtype=torch.float32) if y_weights is not None else None
    for r, rec in enumerate(received):
        mine = rec.src_rank == s
        tokens = rec.src_token[mine]
        acc[tokens] += ys[r][mine].float()
        if wacc is not None:
            wacc[tokens] += y_weights[r][mine]
    return acc.to(torch.bfloat16), wacc


# ----------------------------------------------------------------------------------------------
# Two tiers (a Buffer with two_tier=True): the world is `nodes` x `local` ranks, rank
# `m * local + l`.


def two_stage_order(rec, local):
    """Row `i` of a two-tier dispatch's output is row ``order[i]`` of the flat one: rows
    grouped by the forwarding local rank ``l`` (the source's local rank), then by source node,
    each source's rows in token order."""
    key = (rec.src_rank % local) * 1_000_000 + rec.src_rank // local
    return torch.sort(key, stable=True).indices


def two_tier_combine(received, ys, y_weights, s, num_tokens, hidden, top_k, local):
    """Rank `s`'s combined tokens in two stages: each node sums its ranks' rows (fp32, local
    rank order) into one partial rounded to bf16; the source sums the partials of every node
    (fp32, node order) and rounds once. Weights: the same order, in fp32, never rounded.
    ``ys[r]`` are rank r's rows in the flat order."""
    world = len(received)
    nodes = world // local
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32)
    wacc = torch.zeros((num_tokens, top_k), dtype=torch.float32) if y_weights is not None else None
    for m in range(nodes):
        part = torch.zeros((num_tokens, hidden), dtype=torch.float32)
        wpart = torch.zeros((num_tokens, top_k), dtype=torch.float32) if wacc is not None else None
        touched = torch.zeros(num_tokens, dtype=torch.bool)
        for r in range(m * local, (m + 1) * local):
            rec = received[r]
            mine = rec.src_rank == s
            tokens = rec.src_token[mine]
            part[tokens] += ys[r][mine].float()
            touched[tokens] = True
            if wpart is not None:
                wpart[tokens] += y_weights[r][mine]
        acc[touched] += part[touched].to(torch.bfloat16).float()
        if wacc is not None:
            wacc[touched] += wpart[touched]
    return acc.to(torch.bfloat16), wacc
