"""``deep_ep.Buffer`` on epcomm: DeepEP V1's ``Buffer`` API (signatures, tuple layouts,
defaults) over :class:`epcomm.Buffer`.

DeepEP's Buffer knows only byte budgets; an :class:`epcomm.Buffer` fixes its shape at creation.
So this class creates its epcomm Buffers (its *cores*) lazily, at the first op that shows the
shape (every rank issues the same ops in the same order, as DeepEP requires, so the collective
creation there is safe):

* the **normal core** at the first ``dispatch``: ``hidden`` from ``x``, ``num_topk`` from
  ``topk_idx`` (or the latest ``get_dispatch_layout``), ``num_experts`` from
  ``num_tokens_per_expert`` (or ``get_dispatch_layout``), the SMs from ``config.num_sms`` (or
  :attr:`Buffer.num_sms`), and ``max_tokens_per_rank`` = the most tokens whose epcomm memory fits
  ``num_nvl_bytes`` (:func:`epcomm.deep_ep.config.fit_tokens`);
* the **low-latency core** at the first ``low_latency_dispatch``: its shape and
  ``num_max_dispatch_tokens_per_rank``, checked against ``num_rdma_bytes``.

On a group of several nodes (:mod:`epcomm.deep_ep.nodes`: hosts, or logical nodes of
``EPCOMM_DEEP_EP_NODE_SIZE`` ranks) the normal core is a two-tier epcomm Buffer and the normal
ops return DeepEP's internode results (:mod:`epcomm.deep_ep._internode`: rows in DeepEP's order,
the 10-tuple :class:`InternodeHandle`).

Later ops whose shape differs from their core's raise :class:`epcomm.InvalidArgumentError`
naming the argument and the fixed value. The two cores are separate epcomm Buffers (each with
its own memory and communication stream), so normal and low-latency ops may use different
shapes, as in DeepEP.

Importing this module needs no torch; creating a Buffer does (``_impl``).
"""

from .._args import check_bool, check_int, fail
from . import config as _config
from .handles import InternodeHandle, IntranodeHandle, LowLatencyHandle

__all__ = ["Buffer", "InternodeHandle", "IntranodeHandle", "LowLatencyHandle"]


_IMPL = []


def _ops(buf):
    """The module serving `buf`'s normal ops: the several-node one for a group spanning
    (logical) nodes, else the one-node one (which also reports a Buffer not yet set up)."""
    impl = _impl()
    plan = getattr(buf, "_plan", None)
    if plan is not None and plan.internode:
        from . import _internode as several_nodes

        return several_nodes
    return impl


def _impl():
    """The torch side of the layer (imported at the first call that needs it)."""
    if not _IMPL:
        try:
            from . import _impl
        except ImportError as e:
            raise ImportError(f"deep_ep.Buffer needs PyTorch with CUDA support ({e})") from e
        _IMPL.append(_impl)
    return _IMPL[0]


class Buffer:
    """DeepEP's ``Buffer`` on epcomm (see the module docs for how it maps).

    DeepEP's arguments: ``group`` (a ``torch.distributed`` group; None: the default group when
    ``torch.distributed`` is initialised, else the launcher's variables ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). A group of several
    nodes (hosts, or logical nodes of ``EPCOMM_DEEP_EP_NODE_SIZE`` ranks: :mod:`.nodes`) runs
    DeepEP's internode path (a two-tier normal core, :mod:`._internode`; it needs a
    ``torch.distributed`` group); a group of one node, the intranode path. ``num_nvl_bytes``:
    the budget of the normal core (0: no normal ops, as in DeepEP); ``num_rdma_bytes``: the
    budget of the low-latency core (see :meth:`get_low_latency_rdma_size_hint`). ``low_latency_mode``, ``num_qps_per_rank``,
    ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``use_fabric``: accepted, no effect
    (NVSHMEM/IBGDA settings; epcomm's transports set up their own). ``comm`` (mpi4py): accepted
    and unused where a ``torch.distributed`` group exists, refused where it would be the only
    rendezvous. ``explicitly_destroy``: as in DeepEP, :meth:`destroy` needs it.
    ``enable_shrink=True``: rank masking for the low-latency ops (a rank whose wait expires is
    masked instead of failing the op; see :meth:`low_latency_query_mask_buffer`), and
    :meth:`clean_low_latency_buffer` becomes a collective check-in that masks the ranks that do
    not arrive.

    epcomm-only keywords: ``max_tokens_per_rank`` (fixes the normal core's token limit instead
    of deriving it from ``num_nvl_bytes``; e.g. to keep CUDA-graph captures' ``num_worst_tokens
    >= num_ranks * max_tokens_per_rank`` small), ``transport`` (None: ``ipc`` on one node, the
    internode transport of :mod:`.nodes` on several), ``schedule``, ``routes``, ``timeout`` (as
    :class:`epcomm.Buffer`).

    Collective, like every op: all ranks create it and call its ops in the same order.
    """

    #: SMs of the normal core when its first dispatch has no ``config`` (DeepEP's default 20).
    num_sms = _config.DEFAULT_NUM_SMS

    def __init__(
        self,
        group,
        num_nvl_bytes=0,
        num_rdma_bytes=0,
        low_latency_mode=False,
        num_qps_per_rank=24,
        allow_nvlink_for_low_latency_mode=True,
        allow_mnnvl=False,
        use_fabric=False,
        explicitly_destroy=False,
        enable_shrink=False,
        comm=None,
        *,
        max_tokens_per_rank=None,
        transport=None,
        schedule="epoch",
        routes="auto",
        timeout=100.0,
    ):
        # Every torch-free rule first: a bad argument raises before anything is touched.
        self._normal = None
        self._ll = None
        self._destroyed = False
        check_int("num_nvl_bytes", num_nvl_bytes)
        check_int("num_rdma_bytes", num_rdma_bytes)
        check_int("num_qps_per_rank", num_qps_per_rank)
        for name, value in (
            ("low_latency_mode", low_latency_mode),
            ("allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode),
            ("allow_mnnvl", allow_mnnvl),
            ("use_fabric", use_fabric),
            ("explicitly_destroy", explicitly_destroy),
            ("enable_shrink", enable_shrink),
        ):
            check_bool(name, value)
        if max_tokens_per_rank is not None:
            check_int("max_tokens_per_rank", max_tokens_per_rank, minimum=1)
        from .. import parse_transport

        for name, value in (("transport", transport), ("schedule", schedule), ("routes", routes)):
            if not isinstance(value, str) and not (name == "transport" and value is None):
                fail(name, f"must be a str (got {value!r})")
        if transport is not None:
            transport = parse_transport(transport)
        try:
            timeout = float(timeout)
        except (TypeError, ValueError):
            fail("timeout", f"must be a number of seconds (got {timeout!r})")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        # Mask updates made before the low-latency core exists (it is created at the first
        # low-latency op, which shows the shape): rank -> masked, applied at its creation.
        self._mask_before_core = {}
        self._max_tokens_per_rank = max_tokens_per_rank
        self._options = dict(transport=transport, schedule=schedule, routes=routes, timeout=timeout)
        self._layout_shape = None
        self._combine_buffer = None
        self._side = None
        self._plan = None
        _impl().init(self, group, comm)

    # ------------------------------------------------------------------------------------------
    # Static helpers (no GPU needed)

    @staticmethod
    def is_sm90_compiled():
        """True: epcomm's kernels are SM90 builds and its FP8 paths are in every build."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms):
        """Sets :attr:`Buffer.num_sms`, the SMs of normal cores created from now on without a
        ``config`` (a Buffer whose normal core exists keeps its count)."""
        check_int("new_num_sms", new_num_sms, minimum=1)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        """An :class:`EventOverlap` holding an event recorded on the current stream now."""
        return _impl().capture()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        """A ``num_rdma_bytes`` for the low-latency ops of this shape: epcomm's low-latency
        memory planned for top-k 11, the most DeepEP's low-latency kernels take
        (:func:`epcomm.deep_ep.config.ll_size_hint`; epcomm plans per (token, k))."""
        return _config.ll_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks):
        """DeepEP's recommended dispatch :class:`Config` with :attr:`Buffer.num_sms` SMs (its
        chunk sizes, which have no effect here; DeepEP's defaults for rank counts its table
        lacks, such as 1)."""
        return _config.dispatch_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks):
        """DeepEP's recommended combine :class:`Config` with :attr:`Buffer.num_sms` SMs (as
        :meth:`get_dispatch_config`)."""
        return _config.combine_config(Buffer.num_sms, num_ranks)

    # ------------------------------------------------------------------------------------------
    # Facts

    @property
    def runtime(self):
        """The epcomm Buffer behind the ops: the normal core, else the low-latency core, else
        None (before any op, and after :meth:`destroy`). Not DeepEP's C++ runtime."""
        return self._normal if self._normal is not None else self._ll

    def get_comm_stream(self):
        """The stream the normal ops run on: the normal core's communication stream, else the
        low-latency core's, else (before the first op creates a core) the layer's own stream,
        on which ``get_dispatch_layout`` runs until then. The low-latency ops run on the
        low-latency core's stream."""
        return _impl().comm_stream(self)

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        """Refused: epcomm's symmetric memory is laid out by the library (receive regions,
        counters, flags) and is not exposed as a raw tensor."""
        fail(
            "get_local_buffer_tensor",
            "epcomm's symmetric memory is laid out by the library (receive regions, counters) and is not exposed "
            "as a raw tensor",
        )

    def destroy(self):
        """Frees both cores (collective). Needs ``explicitly_destroy=True``, as in DeepEP; the
        Buffer takes no op afterwards (:class:`epcomm.BufferFailedError`). Refused
        (:class:`epcomm.InvalidArgumentError` naming ``destroy``, before either core is touched)
        while a tensor still views memory it frees: a low-latency dispatch's ``recv_x``, scales,
        ``recv_count`` or handle (``src_info``, ``layout_range``), or a slice or view of them;
        drop them or keep ``.clone()``s, then call it again."""
        _impl().destroy(self)

    # ------------------------------------------------------------------------------------------
    # Normal mode

    def get_dispatch_layout(
        self, topk_idx, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False
    ):
        """``(num_tokens_per_rank [num_ranks] int32, num_tokens_per_rdma_rank, num_tokens_per_expert
        [num_experts] int32, is_token_in_rank [num_tokens, num_ranks] bool, event)`` of
        ``topk_idx`` (``[num_tokens, num_topk]`` int64; ``-1`` and ids outside ``[0,
        num_experts)`` count nowhere); ``num_tokens_per_rdma_rank``: None on one node, else
        ``[num_nodes]`` int32, the tokens going to at least one rank of each node. No
        communication; remembers ``num_topk`` and ``num_experts`` for the first dispatch. Runs on
        the normal core's kernel when the core is flat and has this shape, else with torch ops
        on :meth:`get_comm_stream`; the numbers are the same."""
        return _ops(self).get_dispatch_layout(
            self, topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream
        )

    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment=1,
        num_worst_tokens=0,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        """DeepEP's ``dispatch`` on the normal core (created by the first call): the intranode
        one on a group of one node, the internode one (:meth:`internode_dispatch`) on several.

        ``x``: bf16 ``[num_tokens, hidden]`` or ``(e4m3 x, f32 scales [num_tokens, hidden /
        128])`` (strided scales, e.g. DeepEP's column-major ones, are copied contiguous first).
        With ``topk_idx``: routed by it (``is_token_in_rank`` from ``get_dispatch_layout`` lets
        epcomm reuse its layout). Without ``topk_idx`` (and without ``handle``): routed by
        ``is_token_in_rank`` and ``num_tokens_per_expert``; ``recv_topk_idx`` and
        ``recv_topk_weights`` are None. With ``handle`` (an :class:`IntranodeHandle`): cached
        dispatch along its routing. ``num_tokens_per_rdma_rank`` is accepted and unused (DeepEP's
        intranode dispatch ignores it too).

        Returns DeepEP's ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)`` (cached: ``(recv_x, None, None, None,
        None, event)``), with epcomm's receive order (by source rank, then source token)."""
        return _ops(self).dispatch(
            self,
            x,
            handle,
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            expert_alignment,
            num_worst_tokens,
            config,
            previous_event,
            async_finish,
            allocate_on_comm_stream,
        )

    def combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        """DeepEP's ``combine``: ``(combined_x, combined_topk_weights or None, event)``; on one
        node the sums run in rank order in fp32, rounded to bf16 once (epcomm's contract); on
        several, :meth:`internode_combine`.
        ``bias``: a bf16 ``[num_tokens, hidden]`` tensor or a tuple of two (None allowed),
        added after the sum: ``bf16((f32(bias_0) + f32(bias_1)) + f32(combined))``, one bf16
        rounding more than DeepEP, which adds them before its single rounding."""
        return _ops(self).combine(
            self, x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream
        )

    def internode_dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment=1,
        num_worst_tokens=0,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        """DeepEP's internode dispatch (what :meth:`dispatch` runs on a group of several
        nodes), on the two-tier normal core; refused naming ``group`` on a group of one node.

        Routed by ``topk_idx`` (``topk_weights`` optional), or without it by
        ``is_token_in_rank`` + ``num_tokens_per_expert`` (each token then goes to at most
        ``num_topk`` ranks; ids and weights are not returned), or along ``handle`` (cached).
        ``num_tokens_per_rank`` and ``num_tokens_per_rdma_rank`` are accepted and recomputed
        from the routing. Received rows come in DeepEP's order (by global source rank, each
        source's rows in token order), permuted from the core's on the GPU. Each non-cached
        dispatch exchanges every rank's counts over the group (a host wait, as the receive
        count is); ``num_worst_tokens > 0`` pads the outputs to that many rows (ids ``-1``,
        weights and rows 0) and returns an empty per-expert list, but still waits on the host:
        no internode op can be captured into a CUDA graph.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)`` (cached: ``(recv_x, None, None, None, None, event)``); ``handle`` is an
        :class:`InternodeHandle`."""
        if not getattr(self, "_plan", None) or not self._plan.internode:
            _internode()
        return self.dispatch(
            x,
            handle,
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            expert_alignment,
            num_worst_tokens,
            config,
            previous_event,
            async_finish,
            allocate_on_comm_stream,
        )

    def internode_combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        """DeepEP's internode combine (what :meth:`combine` runs on a group of several nodes):
        ``x`` (and ``topk_weights``) in the dispatch's returned order and row count, reordered
        for the two-tier core on the GPU; each node sums its ranks' rows in fp32 (local-rank
        order) into one bf16 partial, the source sums the partials in fp32 in node order and
        rounds once (weights: the same order, fp32, no rounding). ``bias`` as in
        :meth:`combine`. Refused naming ``group`` on a group of one node."""
        if not getattr(self, "_plan", None) or not self._plan.internode:
            _internode()
        return self.combine(
            x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream
        )

    # ------------------------------------------------------------------------------------------
    # Low latency

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Nothing to clean: epcomm's low-latency counters carry each op's tag, so stale values
        from earlier ops (normal or low-latency) are never mistaken for new ones. Checks the
        arguments against the low-latency core when it exists. With ``enable_shrink=True`` it is
        a collective check-in (an empty low-latency dispatch): a rank that does not arrive
        within ``timeout`` is masked, as DeepEP's clean does; it also ends the validity of
        earlier low-latency handles, as any dispatch does."""
        _impl().clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(
        self,
        x,
        topk_idx,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        cumulative_local_expert_recv_stats=None,
        dispatch_wait_recv_cost_stats=None,
        use_fp8=True,
        round_scale=False,
        use_ue8m0=False,
        async_finish=False,
        return_recv_hook=False,
        *,
        use_nvfp4=False,
        x_global_scale=None,
    ):
        """DeepEP's ``low_latency_dispatch`` on the low-latency core (created by the first
        call, checked against ``num_rdma_bytes``).

        Returns ``(recv_x, recv_count, handle, event, hook)`` in DeepEP's layouts: ``recv_x``
        bf16 ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`` (a
        view of the core's receive set, valid until the second-next low-latency dispatch), or
        with ``use_fp8`` ``(e4m3 rows of that shape, scales)``: f32 ``[..., hidden // 128]``,
        or with ``use_ue8m0`` int32 ``[..., hidden // 512]`` holding four UE8M0 exponent bytes
        (little-endian, one per 128 channels), both column-major in their last two dimensions
        as DeepEP's. The f32 scales are written in that layout by the dispatch kernel, a view
        of the receive set like the rows (valid until the second-next low-latency dispatch);
        the UE8M0 ones are a fresh tensor per call, packed from the f32 scales by a copy (on
        the current stream, on the comm stream before the returned event with
        ``async_finish``, or inside ``hook()``). ``use_ue8m0`` needs ``round_scale=True`` and
        ``hidden % 512 == 0``. ``dispatch_wait_recv_cost_stats`` must be None (epcomm's
        ``last_op_stats`` reports waits instead). ``use_nvfp4`` and ``x_global_scale`` (NVFP4
        rows, from a DeepEP branch; vLLM and SGLang pass them for NVFP4 models) are accepted as
        keywords and refused when used: epcomm sends BF16 or FP8 rows."""
        if use_nvfp4 or x_global_scale is not None:
            fail(
                "use_nvfp4" if use_nvfp4 else "x_global_scale",
                "NVFP4 low-latency dispatch (a DeepEP branch's) is not supported: epcomm sends BF16 or FP8 "
                "(e4m3, one scale per 128 channels) rows; pass use_fp8=True instead",
            )
        return _impl().low_latency_dispatch(
            self,
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats,
            use_fp8,
            round_scale,
            use_ue8m0,
            async_finish,
            return_recv_hook,
        )

    def low_latency_combine(
        self,
        x,
        topk_idx,
        topk_weights,
        handle,
        use_logfmt=False,
        zero_copy=False,
        async_finish=False,
        return_recv_hook=False,
        out=None,
        combine_wait_recv_cost_stats=None,
        *,
        overlap=None,
        packed_recv_count=None,
        comp_signal=None,
        block_m=None,
        threshold=None,
        num_sms=None,
        src_signals=None,
        src_signal_expect_value=None,
    ):
        """DeepEP's ``low_latency_combine``: ``(combined_x, event, hook)``. ``zero_copy=True``
        reads the expert outputs from the tensor :meth:`get_next_low_latency_combine_buffer`
        returned (``x`` is then unused). ``use_logfmt=True`` is refused (epcomm sends bf16
        rows); ``combine_wait_recv_cost_stats`` must be None. The single-batch-overlap keywords
        of a DeepEP branch (``overlap``, ``packed_recv_count``, ``comp_signal``, ``block_m``,
        ``threshold``, ``num_sms``, ``src_signals``, ``src_signal_expect_value``; SGLang passes
        them when its single-batch overlap is on) are accepted and refused when given: epcomm's
        combine starts sending when it is called, not on a signal of the expert kernel."""
        # One cheap test on the decode path; the message is built only for a refusal.
        if (
            (overlap is not None and overlap is not False)
            or packed_recv_count is not None
            or comp_signal is not None
            or block_m is not None
            or threshold is not None
            or num_sms is not None
            or src_signals is not None
            or src_signal_expect_value is not None
        ):
            _refuse_overlap(
                overlap=overlap,
                packed_recv_count=packed_recv_count,
                comp_signal=comp_signal,
                block_m=block_m,
                threshold=threshold,
                num_sms=num_sms,
                src_signals=src_signals,
                src_signal_expect_value=src_signal_expect_value,
            )
        return _impl().low_latency_combine(
            self,
            x,
            topk_idx,
            topk_weights,
            handle,
            use_logfmt,
            zero_copy,
            async_finish,
            return_recv_hook,
            out,
            combine_wait_recv_cost_stats,
        )

    def get_next_low_latency_combine_buffer(self, handle):
        """A bf16 ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]``
        tensor owned by this Buffer (one per Buffer, allocated at the first call) for a
        ``zero_copy=True`` combine to read. It saves no copy here (epcomm's combine reads its
        input once either way); it exists so that DeepEP code runs. The current stream waits for
        the low-latency core's stream first, so a write to it cannot overtake an earlier
        combine still reading it."""
        return _impl().next_combine_buffer(self, handle)

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Masks (``mask=True``) or unmasks rank ``rank_to_mask`` for the low-latency ops issued
        next (needs ``enable_shrink=True``): a masked rank is sent no rows and waited for by
        nothing; its tokens and experts count as absent. Stream-ordered, no host wait."""
        _needs_shrink(self)
        _impl().update_mask(self, rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        """Writes the mask into ``mask_status`` (``[num_ranks]`` ``torch.int``: 1 masked, 0 not),
        as the ops issued so far leave it (needs ``enable_shrink=True``). Stream-ordered."""
        _needs_shrink(self)
        _impl().query_mask(self, mask_status)

    def low_latency_clean_mask_buffer(self):
        """Unmasks every rank (needs ``enable_shrink=True``). Stream-ordered."""
        _needs_shrink(self)
        _impl().clean_mask(self)


def _internode():
    fail(
        "group",
        "is one node, and the internode ops need several: a group spanning hosts, or logical nodes of "
        "EPCOMM_DEEP_EP_NODE_SIZE ranks (dispatch and combine serve a group of one node)",
    )


def _needs_shrink(buf):
    if not getattr(buf, "enable_shrink", False):
        fail("enable_shrink", "is False for this Buffer: rank masking needs Buffer(..., enable_shrink=True)")


def _refuse_overlap(**given):
    """Refuses the single-batch-overlap keywords of a DeepEP branch, naming the first given."""
    names = [name for name, value in given.items() if value is not None and value is not False]
    fail(
        names[0],
        "single-batch overlap (a DeepEP branch's: the combine waiting on the expert kernel's signals) is "
        "not supported: call low_latency_combine once the expert outputs are complete, without " + ", ".join(names),
    )
