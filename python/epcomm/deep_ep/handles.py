"""DeepEP's handles: tuples with DeepEP's element order and meaning, each carrying the epcomm
handle it stands for (``epcomm_handle``), which the ops that take a handle use. No torch needed
to import."""

__all__ = ["IntranodeHandle", "LowLatencyHandle"]


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


class LowLatencyHandle(_Handle):
    """DeepEP's low-latency handle: the 5-tuple ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``, carrying the
    :class:`epcomm.LowLatencyHandle` it stands for (``epcomm_handle``). ``src_info``
    (``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank]`` int32, source token
    of every row) and ``layout_range`` (``[num_local_experts, num_ranks]`` int64, ``first row <<
    32 | rows`` per source rank) have DeepEP's shapes and meaning; both are views valid until
    the second-next low-latency dispatch."""
