"""DeepEP's handles: tuples with DeepEP's element order and meaning, each carrying the epcomm
handle it stands for (``epcomm_handle``), which the ops that take a handle use. No torch needed
to import."""

__all__ = ["InternodeHandle", "IntranodeHandle", "LowLatencyHandle"]


class _Handle(tuple):
    """A tuple of DeepEP's elements that carries ``epcomm_handle``."""

    def __new__(cls, items, epcomm_handle):
        self = super().__new__(cls, items)
        self.epcomm_handle = epcomm_handle
        return self


class IntranodeHandle(_Handle):
    """DeepEP's intranode dispatch handle: the 6-tuple ``(rank_prefix_matrix,
    channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
    send_head)``, carrying the :class:`epcomm.DispatchHandle` it stands for
    (``epcomm_handle``), which ``dispatch(handle=...)`` and ``combine`` use.

    * ``rank_prefix_matrix`` (``[num_ranks, num_ranks]`` int32): column ``rank`` (this rank) is
      exact: ``[i][rank]`` is the end row (exclusive) of source rank ``i``'s rows in this rank's
      receive order. The other columns (other ranks' receive prefixes, which epcomm does not
      send back) are ``-1``.
    * ``recv_src_idx`` (``[num_rows]`` int32): the source token index of each returned row (a
      copy of the epcomm handle's; rows past the received ones, with ``num_worst_tokens``, hold
      no index).
    * ``is_token_in_rank`` (``[num_tokens, num_ranks]`` bool): the one the dispatch was given,
      else computed from its ``topk_idx``.
    * ``channel_prefix_matrix``, ``recv_channel_prefix_matrix``, ``send_head`` (DeepEP's
      per-channel staging state; epcomm has no channels): None.
    """


class InternodeHandle(_Handle):
    """DeepEP's internode dispatch handle (a group of several nodes): the 10-tuple
    ``(is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
    recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
    recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head)``, carrying the
    two-tier :class:`epcomm.DispatchHandle` it stands for (``epcomm_handle``) and the row order
    between the two (``order``: a :class:`ReceiveOrder`), which ``dispatch(handle=...)`` and
    ``combine`` use.

    * ``is_token_in_rank`` (``[num_tokens, num_ranks]`` bool): the one the dispatch was given,
      else computed from its ``topk_idx``.
    * ``recv_rdma_rank_prefix_sum`` (``[num_nodes]`` int32): exact; element ``m`` is the number
      of tokens of nodes ``0..m`` that crossed the rail to this rank (the tokens of the ranks
      with this rank's local rank that go to any rank of this node), inclusive prefix sums.
    * ``recv_gbl_rank_prefix_sum`` (``[num_ranks]`` int32): exact; element ``i`` is the end
      row (exclusive) of source rank ``i``'s rows in the returned order (DeepEP's: by global
      source rank, each source's rows in token order).
    * ``rdma_channel_prefix_matrix``, ``gbl_channel_prefix_matrix``,
      ``recv_rdma_channel_prefix_matrix``, ``recv_gbl_channel_prefix_matrix``,
      ``recv_src_meta``, ``send_rdma_head``, ``send_nvl_head`` (DeepEP's per-channel staging
      and forwarding state; epcomm has no channels, and which ranks of this node a row also
      went to is not known here): None.
    """

    def __new__(cls, items, epcomm_handle, order):
        self = super().__new__(cls, items, epcomm_handle)
        self.order = order
        return self


class ReceiveOrder:
    """How an internode dispatch's rows map between the two-tier core's order and DeepEP's:
    ``perm`` (int64 ``[num_recv]`` on the GPU): DeepEP row ``i`` is core row ``perm[i]``;
    ``inv``: its inverse (core row ``k`` is DeepEP row ``inv[k]``); ``num_recv``: rows
    received; ``num_rows``: rows the dispatch returned (``num_worst_tokens`` when it padded)."""

    def __init__(self, perm, inv, num_recv, num_rows):
        self.perm = perm
        self.inv = inv
        self.num_recv = num_recv
        self.num_rows = num_rows

    def __repr__(self):
        return f"ReceiveOrder(num_recv={self.num_recv}, num_rows={self.num_rows})"


class LowLatencyHandle(_Handle):
    """DeepEP's low-latency handle: the 5-tuple ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``, carrying the
    :class:`epcomm.LowLatencyHandle` it stands for (``epcomm_handle``). ``src_info``
    (``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank]`` int32, source token
    of every row) and ``layout_range`` (``[num_local_experts, num_ranks]`` int64, ``first row <<
    32 | rows`` per source rank) have DeepEP's shapes and meaning; both are views valid until
    the second-next low-latency dispatch."""
