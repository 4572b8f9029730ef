"""``epcomm.Buffer``: DeepEP's normal-mode ``Buffer`` API (``get_dispatch_layout``,
``dispatch``, cached dispatch, ``combine``) and its low-latency ops (``low_latency_dispatch``,
``low_latency_combine``: ``_low_latency``) on epcomm, for PyTorch.

How it maps onto the native layer (``epcomm._native``, torch-free):

* every op runs on the Buffer's communication stream (:meth:`Buffer.get_comm_stream`), ordered
  against torch's current stream by events (``_streams``);
* the native layer writes received rows into this rank's symmetric memory; outputs are torch
  tensors allocated here and filled by copies on the comm stream (``zero_copy=True`` returns
  views of the receive rows instead);
* receive rows alternate between two regions (by dispatch parity); the native copy-out
  (``copy_received``) reads the parity from the device's own dispatch count, so copies are
  right at either parity, also when replayed from a CUDA graph: this class tracks no parity.

Ordering of received rows (the contract tests check bit for bit): by source rank, then by
source token index; ``recv_topk_idx`` holds local expert ids (``-1`` where the expert lives on
another rank), ``recv_topk_weights`` the weights there (``0`` elsewhere). ``combine`` sums each
token's rows in rank order in fp32 and rounds to bf16 once.
"""

import time
import weakref

import torch

from . import _ll_args, _low_latency, _native
from ._args import aligned_counts, check, check_bool, check_int, describe, fail
from ._rendezvous import from_group
from ._streams import EventOverlap, StreamOp, register_host_wait, unregister_host_wait
from ._views import ViewGuard, refuse_destroy, view
from .config import DEFAULT_NUM_SMS, Config, check_options, low_latency_size_hint, size_hint
from .stats import OpStats

__all__ = ["Buffer", "DispatchHandle", "EventOverlap", "LowLatencyHandle"]

LowLatencyHandle = _low_latency.LowLatencyHandle

_FP8 = getattr(torch, "float8_e4m3fn", None)
_FP8_BLOCK = _native.FP8_BLOCK


class _LayoutSlot:
    """A native layout, kept for reuse: it goes back to its pool when its last user (the
    ``is_token_in_rank`` tensor it was returned with, the handles dispatched with it) is gone,
    unless a CUDA graph captured it (then the Buffer keeps it for its life). The handles
    allocated for it (each bound to it) wait in ``free_handles`` the same way."""

    def __init__(self, native, num_tokens, pool, buffer_id):
        self.native = native
        self.num_tokens = num_tokens
        self.buffer_id = buffer_id
        self.free_handles = []
        self.topk_ptr = None
        self.pinned = False
        self.views = None
        self._pool = pool
        self._users = 0

    def acquire(self):
        self._users += 1

    def release(self):
        self._users -= 1
        if self._users == 0 and not self.pinned:
            self._pool.append(self)


class _HandleSlot:
    """A capacity-sized native handle of one layout, back in that layout's ``free_handles``
    when its dispatch's handle is gone (unless a CUDA graph captured it)."""

    def __init__(self, native, home):
        self.native = native
        self.pinned = False
        self.count = None
        self._home = home

    def release(self):
        if not self.pinned:
            self._home.append(self)


def check_no_live_views(buffers):
    """Refuses (:class:`~epcomm.InvalidArgumentError` naming ``destroy``) a destroy of
    `buffers` while a tensor still views memory one of them frees; all are checked before any
    is destroyed, so a refusal changes nothing."""
    live = []
    pending_hook = False
    for b in buffers:
        live.extend(b._live_views())
        pending_hook = pending_hook or b._ll_keep is not None
    refuse_destroy(
        live,
        "a low-latency hook not yet called also keeps its op's inputs (e.g. a combine of recv_x): call it first"
        if pending_hook
        else None,
    )


class DispatchHandle:
    """The routing of one dispatch, for ``dispatch(handle=...)`` (cached dispatch) and
    ``combine``. Valid only with the Buffer that made it.

    ``num_recv_tokens``: rows received when the host knows it (a dispatch with
    ``num_worst_tokens=0``), else None; ``num_rows``: rows of the tensors the dispatch returned
    (and that ``combine`` takes); ``num_tokens``: tokens of the batch."""

    def __init__(self, buffer, native, layout, num_rows, num_recv_tokens, handle_slot=None):
        self._buffer_id = id(buffer)
        self._native = native
        self._layout = layout
        self._slot = handle_slot
        self.num_rows = num_rows
        self.num_recv_tokens = num_recv_tokens
        self.num_tokens = layout.num_tokens
        layout.acquire()
        weakref.finalize(self, layout.release)
        if handle_slot is not None:
            weakref.finalize(self, handle_slot.release)

    def __repr__(self):
        return (
            f"DispatchHandle(num_tokens={self.num_tokens}, num_rows={self.num_rows}, "
            f"num_recv_tokens={self.num_recv_tokens})"
        )


class Buffer:
    """One rank's epcomm buffer, with DeepEP's normal-mode API.

    ``group``: the ``torch.distributed`` process group whose ranks take part (the rendezvous
    goes through it); None: the default group when ``torch.distributed`` is initialised, else
    epcomm's own rendezvous from the launcher's variables (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

    The shape is fixed at creation (every rank passes the same values): ``max_tokens_per_rank``
    (most tokens one dispatch sends), ``hidden``, ``num_topk``, ``num_experts``.
    ``num_nvl_bytes``: 0 lets epcomm size its memory; otherwise an upper bound that raises when
    the shape needs more (:meth:`get_buffer_size_hint`).

    Low-latency (decode) ops: ``num_max_dispatch_tokens_per_rank`` (default 0: none) is the
    most tokens a rank passes to one :meth:`low_latency_dispatch`; it plans the low-latency
    memory. ``low_latency_mode=True`` is accepted only with it (it changes nothing else);
    ``num_rdma_bytes`` must then be 0 or an upper bound of the low-latency memory
    (:meth:`get_low_latency_rdma_size_hint`), and must be 0 without it.

    epcomm's own choices: ``transport`` (``"ipc"``, ``"nvshmem"``, ``"nvshmem:vnodes=N"``,
    ``"nvshmem:vnodes=max"``, and the CPU proxy's ``"proxy-ce"``, ``"proxy-verbs"``, each with
    ``:vnodes=N`` too, where compiled in), ``schedule`` (``"epoch"``, ``"global"``), ``routes``
    (``"auto"``, ``"put-signal"``), ``num_sms`` (default :attr:`num_sms`), ``timeout``
    (seconds, bound of every device wait: :class:`epcomm.TimeoutError` names the late rank),
    ``enable_cuda_graphs`` (``False`` refuses CUDA-graph captures of this Buffer's ops; it
    costs nothing either way), ``bootstrap_timeout`` (seconds for the rendezvous),
    ``ll_masking`` (DeepEP's shrink mode: a rank whose wait expires in a low-latency op is
    masked instead of failing the op, and later low-latency ops skip it; see
    :meth:`low_latency_query_mask_buffer`), ``two_tier`` (``True``: the same API over two
    tiers, a rail between the transport's nodes then NVLink inside each, for a group spanning
    hosts or a transport split into logical nodes such as ``"proxy-ce:vnodes=2"``; dispatch
    routes by ``topk_idx`` only, received rows come grouped by forwarding rank then source
    node, and combine reduces each node's rows first; the low-latency ops, routing by
    ``is_token_in_rank``, :meth:`get_dispatch_layout`, :meth:`combine_in_place` and
    :meth:`route_plan` are refused with ``InvalidArgumentError`` naming ``two_tier``, and
    ``num_worst_tokens`` must be 0: two-tier dispatches from Python wait on the host for the
    receive count, so they cannot be captured into a CUDA graph yet).

    Runs on the current CUDA device (``torch.cuda.current_device()``), on PyTorch's primary
    CUDA context. Creating, destroying and every op are collective: all ranks call them in the
    same order.
    """

    #: SMs per op of Buffers created without ``num_sms`` (see :meth:`set_num_sms`).
    num_sms = DEFAULT_NUM_SMS

    def __init__(
        self,
        group=None,
        num_nvl_bytes=0,
        num_rdma_bytes=0,
        low_latency_mode=False,
        *,
        max_tokens_per_rank,
        hidden,
        num_topk,
        num_experts,
        num_sms=None,
        transport="ipc",
        schedule="epoch",
        routes="auto",
        timeout=100.0,
        enable_cuda_graphs=True,
        bootstrap_timeout=300.0,
        explicitly_destroy=False,
        num_max_dispatch_tokens_per_rank=0,
        ll_masking=False,
        two_tier=False,
    ):
        check_int("num_nvl_bytes", num_nvl_bytes)
        check_int("num_rdma_bytes", num_rdma_bytes)
        check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        ll = num_max_dispatch_tokens_per_rank
        _ll_args.check_options(ll, low_latency_mode, num_rdma_bytes)
        check_bool("enable_cuda_graphs", enable_cuda_graphs)
        check_bool("explicitly_destroy", explicitly_destroy)
        check_bool("ll_masking", ll_masking)
        check_bool("two_tier", two_tier)
        num_sms = Buffer.num_sms if num_sms is None else num_sms
        if not torch.cuda.is_available():
            fail("device", "a Buffer needs a CUDA GPU, and torch.cuda.is_available() is False")
        self.device = torch.cuda.current_device()
        bootstrap, world, rank, local_world = self._rendezvous(group, bootstrap_timeout)
        facts = check_options(
            world_size=world,
            max_tokens_per_rank=max_tokens_per_rank,
            hidden=hidden,
            num_topk=num_topk,
            num_experts=num_experts,
            num_sms=num_sms,
            transport=transport,
            schedule=schedule,
            routes=routes,
            timeout=timeout,
            rank=rank,
            local_world_size=local_world,
            num_max_dispatch_tokens_per_rank=ll,
            two_tier=two_tier,
        )
        ll_bytes = facts["low_latency_bytes"]
        if num_rdma_bytes and ll_bytes > num_rdma_bytes:
            fail(
                "num_rdma_bytes",
                f"the low-latency memory of this shape takes {ll_bytes} bytes per rank "
                f"(num_max_dispatch_tokens_per_rank={ll}), more than the {num_rdma_bytes} given; pass 0 to let "
                "epcomm size it",
            )
        normal_bytes = facts["symmetric_bytes"] - ll_bytes
        if num_nvl_bytes and normal_bytes > num_nvl_bytes and not two_tier:
            fail(
                "num_nvl_bytes",
                f"this shape needs {normal_bytes} bytes per rank (max_tokens_per_rank="
                f"{max_tokens_per_rank}, hidden={hidden}, num_topk={num_topk}, num_experts={num_experts}, "
                f"{world} ranks), more than the {num_nvl_bytes} given; pass 0 to let epcomm size it",
            )
        if facts["transport"].startswith("nvshmem") and local_world == world:
            import os

            for key, value in _native.single_host_env_defaults():
                os.environ.setdefault(key, value)
        self._session = _native.Session(
            self.device,
            max_tokens_per_rank,
            hidden,
            num_topk,
            num_experts,
            num_sms,
            facts["transport"],
            schedule,
            routes,
            float(timeout),
            bootstrap,
            ll,
            ll_masking,
            two_tier,
        )
        self.two_tier = two_tier
        self.rank = self._session.rank
        self.group_size = self._session.world_size
        self.hidden = hidden
        self.num_topk = num_topk
        self.num_experts = num_experts
        self.max_tokens_per_rank = max_tokens_per_rank
        self.num_max_dispatch_tokens_per_rank = ll
        self.ll_masking = ll_masking
        self.capacity = self._session.capacity
        self.explicitly_destroy = explicitly_destroy
        self._num_sms = num_sms
        self._comm = torch.cuda.ExternalStream(self._session.stream_handle, device=torch.device("cuda", self.device))
        if self._session.transport.split(":")[0] == "proxy-ce":
            # Held weakly: the registry must not keep a Buffer (and its memory) alive.
            me = weakref.ref(self)

            def wait(event=None):
                buffer = me()
                if buffer is not None:
                    buffer._wait_on_host(event)

            register_host_wait(self._session.stream_handle, wait)
        self._layout_pool = {}
        self._pinned = []
        self._captured = False
        # The latest dispatch returned zero-copy views of its receive rows: a combine then leaves
        # them as they are; otherwise they were copied out and a combine may stage over them.
        self._latest_zero_copy = False
        self._views = {}
        self._ll_views = {}
        # The views of this Buffer's own memory (owner=self: the receive regions), which
        # destroy() frees: it refuses while one is alive (each view names its kind).
        self._view_guard = ViewGuard("receive-region view")
        self._ll_keep = None
        self._graphs = enable_cuda_graphs

    # ------------------------------------------------------------------------------------------
    # Facts and DeepEP's helpers

    @staticmethod
    def _rendezvous(group, bootstrap_timeout):
        """``(bootstrap tuple or None, world, rank, local_world_size)``."""
        import os

        import torch.distributed as dist

        if group is not None or (dist.is_available() and dist.is_initialized()):
            b = from_group(group, bootstrap_timeout)
            return b, b[3], b[2], b[5]
        env = os.environ
        try:
            world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
            local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        except (KeyError, ValueError) as e:
            fail("group", f"no process group given, torch.distributed is not initialised, and the launcher variables are incomplete ({e})")
        return None, world, rank, local_world

    @staticmethod
    def set_num_sms(new_num_sms):
        """Sets the SM count of Buffers created from now on without ``num_sms`` (DeepEP's
        ``Buffer.set_num_sms``; an existing Buffer keeps its own)."""
        Config(new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks):
        """The config dispatch uses by default (DeepEP's helper): :attr:`num_sms` SMs."""
        check_int("num_ranks", num_ranks, minimum=1)
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        """The config combine uses by default (DeepEP's helper): :attr:`num_sms` SMs."""
        check_int("num_ranks", num_ranks, minimum=1)
        return Config(Buffer.num_sms)

    @staticmethod
    def get_buffer_size_hint(num_ranks, max_tokens_per_rank, hidden, num_topk, num_experts):
        """Bytes of symmetric GPU memory per rank for this shape (``num_nvl_bytes``)."""
        return size_hint(num_ranks, max_tokens_per_rank, hidden, num_topk, num_experts)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk):
        """Bytes of symmetric GPU memory per rank that the low-latency regions add for this
        shape (DeepEP's helper; what ``num_rdma_bytes`` may bound). Unlike DeepEP's it needs
        ``num_topk``: the combine rows are planned per (token, k)."""
        return low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk)

    def get_comm_stream(self):
        """The communication stream (a ``torch.cuda.ExternalStream``)."""
        return self._comm

    @property
    def transport(self):
        """The transport spec (canonical form)."""
        return self._session.transport

    @property
    def schedule(self):
        """The schedule (``"epoch"`` or ``"global"``)."""
        return self._session.config()[0]

    @property
    def routes(self):
        """The route policy (``"auto"`` or ``"put-signal"``)."""
        return self._session.config()[1]

    @property
    def timeout(self):
        """Bound of every device wait, seconds."""
        return self._session.config()[3]

    @property
    def symmetric_bytes(self):
        """Bytes of symmetric memory of this rank."""
        return self._session.symmetric_bytes

    def get_num_sms(self):
        """The SMs (blocks) every op of this Buffer uses."""
        return self._num_sms

    def route_plan(self):
        """``[(peer, tier, route)]``: how this rank reaches every rank."""
        return self._session.route_plan()

    def is_failed(self):
        """True after a failure (timeout, peer failure, ...) or destroy: create a new Buffer."""
        return self._session.is_failed

    def synchronize(self):
        """Waits for every op issued so far; raises a device failure."""
        self._session.synchronize()

    def last_op_stats(self):
        """Who waited for whom in the last op (:class:`epcomm.OpStats`), or None before any
        op. Collective: every rank calls it after the same op."""
        d = self._session.last_op_stats()
        return None if d is None else OpStats(**d)

    def inject_delay(self, seconds):
        """Diagnostics: delays the ops issued next on this rank's stream by `seconds` (at most
        10), to see skew attribution and timeouts at work."""
        self._session.inject_delay(float(seconds))

    def _wait_on_host(self, event=None):
        """A ``proxy-ce`` Buffer's synchronous op returns once the comm stream finished it
        (``_streams._host_waits`` says why): waits for an event recorded now, then raises what
        failed on the device. With `event` (an asynchronous op's, at its
        ``current_stream_wait()``): waits for that event only, so ops issued after it keep
        running, and leaves failures to the next synchronous op, as on the other transports.
        Waits by polling, never by a blocking CUDA call, which would stop this Buffer's proxy
        thread the same way; bounded by twice the op timeout (the op's own waits end by then)."""
        done = event
        if done is None:
            done = torch.cuda.Event()
            done.record(self._comm)
        deadline = time.monotonic() + 2 * self.timeout + 1
        while not done.query() and time.monotonic() < deadline:
            time.sleep(0)
        if event is None:
            self._session.synchronize()

    def destroy(self):
        """Frees the buffer after every rank stopped using it (collective).

        Refused (:class:`~epcomm.InvalidArgumentError` naming ``destroy``, on this rank alone,
        before any collective step: nothing is freed or waited for) while a tensor still views
        the memory it frees: the outputs of a ``zero_copy=True`` dispatch, those of
        :meth:`low_latency_dispatch` (``recv_x``, its scales, ``recv_count``) and its
        :class:`LowLatencyHandle` (``src_info``, ``layout_range``), or any slice or ``.view()``
        of them. Drop them (``del``) or keep ``.clone()``s, then call it again (a rank whose
        destroy went ahead waits for it at its barrier, up to the bootstrap timeout)."""
        check_no_live_views((self,))
        self._views.clear()
        self._ll_views.clear()
        unregister_host_wait(self._session.stream_handle)
        self._session.destroy()
        self._ll_keep = None

    def _live_views(self):
        """``[(kind, what)]`` of the views of this Buffer's memory that someone other than the
        Buffer still holds. The low-latency views are cached per receive set (made once); the
        cache itself reads nothing, so it is set aside while counting, then put back with the
        entries whose tensors are still held (a refused destroy changes nothing)."""
        cache, self._ll_views = self._ll_views, {}
        held = {key: tuple(None if t is None else weakref.ref(t) for t in v) for key, v in cache.items()}
        del cache
        try:
            return self._view_guard.live()
        finally:
            for key, refs in held.items():
                v = tuple(None if r is None else r() for r in refs)
                if all((t is not None) == (r is not None) for t, r in zip(v, refs)):
                    self._ll_views.setdefault(key, v)

    # ------------------------------------------------------------------------------------------
    # Argument checks

    def _check_config(self, config):
        if config is None:
            return
        if not isinstance(config, Config):
            fail("config", f"must be an epcomm.Config or None (got {type(config).__name__})")
        if config.num_sms != self._num_sms:
            fail(
                "config",
                f"config.num_sms = {config.num_sms}, but this Buffer runs every op with {self._num_sms} SMs "
                "(fixed at creation: pass num_sms= to Buffer, or Buffer.set_num_sms before creating it)",
            )

    def _tensor(self, argument, t, dtypes, shape, names=()):
        d = describe(argument, t)
        check(argument, d, dtypes=dtypes, shape=shape, device=self.device, shape_names=names)
        return d

    def _x(self, x, num_tokens=None):
        """`x` (bf16 tensor or (fp8 tensor, f32 scales)): ``(x, scales or None, descs)``."""
        if isinstance(x, tuple):
            if len(x) != 2:
                fail("x", f"an FP8 x is a tuple (x, scales) (got a tuple of {len(x)})")
            x, scales = x
            if self.hidden % _FP8_BLOCK != 0:
                fail("x", f"FP8 dispatch needs hidden % {_FP8_BLOCK} == 0 (hidden = {self.hidden})")
            dx = self._tensor("x", x, ("float8_e4m3fn",), (num_tokens, self.hidden), ("num_tokens", "hidden"))
            ds = self._tensor(
                "scales", scales, ("float32",), (dx.shape[0], self.hidden // _FP8_BLOCK), ("num_tokens", "hidden / 128")
            )
            return x, scales, dx, ds
        dx = self._tensor("x", x, ("bfloat16",), (num_tokens, self.hidden), ("num_tokens", "hidden"))
        return x, None, dx, None

    # ------------------------------------------------------------------------------------------
    # Pools (a CUDA graph capture must not allocate: it takes what eager calls left)

    def _layout(self, num_tokens, op):
        """A layout slot for `num_tokens` tokens: a free one, else (outside a capture) a new
        one."""
        pool = self._layout_pool.setdefault(num_tokens, [])
        if pool:
            slot = pool.pop()
        elif op.capturing:
            fail(
                "graph capture",
                f"no routing state for a batch of {num_tokens} tokens was left by an earlier call: run the same "
                "calls once outside the capture first (a warm-up), so that the capture reuses their state",
            )
        else:
            slot = _LayoutSlot(self._session.alloc_layout(num_tokens), num_tokens, pool, id(self))
        if op.capturing:
            self._pin(slot)
        return slot

    def _handle(self, layout, op):
        """A capacity-sized handle slot of `layout`: a free one, else (outside a capture) a new
        one."""
        if layout.free_handles:
            slot = layout.free_handles.pop()
        elif op.capturing:
            fail(
                "graph capture",
                "no routing state for this dispatch was left by an earlier call: run the same calls once outside "
                "the capture first (a warm-up), so that the capture reuses their state",
            )
        else:
            slot = _HandleSlot(self._session.alloc_handle(layout.native), layout.free_handles)
        if op.capturing:
            self._pin(slot)
        return slot

    def _pin(self, slot):
        """Keeps `slot` for the Buffer's life: a captured graph uses its memory."""
        if not slot.pinned:
            slot.pinned = True
            self._pinned.append(slot)

    def _layout_of(self, is_token_in_rank, d_idx, op):
        """The layout for the ``topk_idx`` described by `d_idx`: the one
        ``get_dispatch_layout`` attached to `is_token_in_rank`, when it was computed from the
        same ``topk_idx`` tensor on this Buffer, else one computed here."""
        slot = getattr(is_token_in_rank, "_epcomm_layout", None)
        if (
            isinstance(slot, _LayoutSlot)
            and slot.buffer_id == id(self)
            and slot.num_tokens == d_idx.shape[0]
            and slot.topk_ptr == d_idx.ptr
        ):
            if op.capturing:
                self._pin(slot)
            return slot
        slot = self._layout(d_idx.shape[0], op)
        self._session.layout_into((d_idx.ptr, d_idx.numel), slot.native)
        slot.topk_ptr = d_idx.ptr
        return slot

    # ------------------------------------------------------------------------------------------
    # Receive rows: views of the regions and copies out of them

    def _recv(self, name, out, cols, native_handle):
        """Fills `out` (``[rows, cols]``) from receive array `name` of the latest dispatch (its
        handle: `native_handle`): one native kernel copies the rows the device counted, from
        the region copy the device's dispatch count names; rows past the count are left as
        they are."""
        rows = min(out.shape[0], self.capacity)
        if rows == 0:
            return
        dtype = torch.uint8 if out.dtype == _FP8 else out.dtype
        dst = out.view(dtype)[:rows]
        self._session.copy_received(native_handle, name, dst.data_ptr(), rows * cols * dst.element_size())

    def _check_graph_state(self, op, mode_host_sync, zero_copy, what):
        if op.capturing:
            if not self._graphs:
                fail("graph capture", f"this Buffer was created with enable_cuda_graphs=False: {what} cannot be captured")
            if mode_host_sync:
                fail(
                    "num_worst_tokens",
                    f"a {what} inside a CUDA graph capture must not wait on the host: pass "
                    f"num_worst_tokens >= {self.capacity} (num_ranks * max_tokens_per_rank)",
                )
        if zero_copy and (op.capturing or self._captured):
            fail(
                "zero_copy",
                "views of the receive rows name one of two alternating regions, which a CUDA graph replay "
                "cannot follow: not available inside a capture, nor on a Buffer that captured a dispatch",
            )
        if mode_host_sync and self._captured:
            fail(
                "num_worst_tokens",
                "this Buffer captured a dispatch into a CUDA graph, so its host no longer knows the device's op "
                f"count and cannot wait for a receive count: pass num_worst_tokens >= {self.capacity} (or use "
                "another Buffer for host-synchronised dispatches)",
            )

    # ------------------------------------------------------------------------------------------
    # DeepEP's API

    def get_dispatch_layout(
        self, topk_idx, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False
    ):
        """Routing statistics of ``topk_idx`` (``[num_tokens, num_topk]`` int64, ``-1`` = no
        expert): ``(num_tokens_per_rank [num_ranks] int32, None, num_tokens_per_expert
        [num_experts] int32, is_token_in_rank [num_tokens, num_ranks] bool, event)``."""
        if num_experts != self.num_experts:
            fail("num_experts", f"must be this Buffer's num_experts = {self.num_experts} (got {num_experts!r})")
        if self.two_tier:
            fail(
                "two_tier",
                "get_dispatch_layout reports the flat routing; a two-tier Buffer computes its tiers' layouts "
                "inside dispatch: call dispatch with topk_idx",
            )
        d_idx = self._tensor("topk_idx", topk_idx, ("int64",), (None, self.num_topk), ("num_tokens", "num_topk"))
        op = StreamOp(self._comm, previous_event, async_finish, allocate_on_comm_stream)
        op.use(topk_idx)
        op.begin()
        world, n = self.group_size, d_idx.shape[0]
        with torch.cuda.stream(op.alloc_stream()):
            per_rank = torch.empty(world, dtype=torch.int32, device=self.device)
            per_expert = torch.empty(self.num_experts, dtype=torch.int32, device=self.device)
            in_rank = torch.empty((n, world), dtype=torch.bool, device=self.device)
        layout = self._layout(n, op)
        self._session.layout_into((d_idx.ptr, d_idx.numel), layout.native)
        layout.topk_ptr = d_idx.ptr
        if layout.views is None:
            counts = view(layout.native.counts_ptr, (world + self.num_experts,), torch.int32, self.device, layout.native)
            slots = view(layout.native.token_slot_ptr, (n, world), torch.int32, self.device, layout.native)
            layout.views = (counts, slots)
        counts, slots = layout.views
        with torch.cuda.stream(self._comm):
            per_rank.copy_(counts[:world])
            per_expert.copy_(counts[world:])
            torch.ge(slots, 0, out=in_rank)
        in_rank._epcomm_layout = layout
        layout.acquire()
        weakref.finalize(in_rank, layout.release)
        op.output(per_rank, per_expert, in_rank)
        return per_rank, None, per_expert, in_rank, op.finish()

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
        *,
        zero_copy=False,
    ):
        """Sends every token to each rank holding one of its experts (DeepEP's ``dispatch``).

        ``x``: ``[num_tokens, hidden]`` bf16, or ``(x, scales)`` with e4m3 ``x`` and f32
        ``scales [num_tokens, hidden / 128]``. ``topk_idx`` (int64) and ``topk_weights``
        (f32), ``[num_tokens, num_topk]``. The layout tensors from :meth:`get_dispatch_layout`
        may be passed (its layout is then reused) or omitted (computed here). With ``handle``
        (a :class:`DispatchHandle`): cached dispatch along that routing (``topk_idx`` and
        ``topk_weights`` must be None).

        Without ``topk_idx`` (and without ``handle``) the routing is given, as in DeepEP:
        ``is_token_in_rank`` (``[num_tokens, num_ranks]`` bool) says where each token goes and
        ``num_tokens_per_expert`` (``[num_experts]`` int32) is reported to the receivers as
        their per-expert counts; only rows travel (``recv_topk_idx`` and
        ``recv_topk_weights`` are None; ``topk_weights`` must be None).

        ``num_worst_tokens = 0``: the host waits for the receive count and the outputs have
        exactly the received rows. ``num_worst_tokens > 0``: no host wait (CUDA-graph
        capturable when ``>= num_ranks * max_tokens_per_rank``); outputs have
        ``num_worst_tokens`` rows, rows past the received ones hold ``-1`` ids and ``0``
        weights, and ``num_recv_tokens_per_expert_list`` is empty.

        ``zero_copy=True`` (epcomm's extra): the returned ``recv_x`` (scales, ids, weights)
        are views of this rank's receive rows, valid until the next dispatch on this Buffer
        (write expert outputs over ``recv_x`` and call :meth:`combine_in_place`).

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``; a cached dispatch returns ``(recv_x, None, None, None, None, event)``.
        """
        del num_tokens_per_rank  # the native layout holds it
        if num_tokens_per_rdma_rank is not None:
            fail("num_tokens_per_rdma_rank", "must be None: epcomm's normal mode has no RDMA ranks")
        check_int("expert_alignment", expert_alignment, minimum=1)
        check_int("num_worst_tokens", num_worst_tokens)
        check_bool("zero_copy", zero_copy)
        if self.two_tier and num_worst_tokens != 0:
            fail(
                "num_worst_tokens",
                "must be 0 on a two-tier Buffer for now: its dispatches wait on the host for the receive count "
                "(the dispatch without a host wait, and so CUDA-graph capture, is not available from Python "
                "with two tiers yet)",
            )
        self._check_config(config)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                fail("handle", "a cached dispatch (handle given) takes no topk_idx or topk_weights")
            return self._cached_dispatch(x, handle, previous_event, async_finish, allocate_on_comm_stream, zero_copy)
        x, scales, dx, ds = self._x(x)
        n = dx.shape[0]
        d_idx = d_w = d_in = d_pe = None
        if topk_idx is not None:
            d_idx = self._tensor("topk_idx", topk_idx, ("int64",), (n, self.num_topk), ("num_tokens", "num_topk"))
            if topk_weights is not None:
                d_w = self._tensor(
                    "topk_weights", topk_weights, ("float32",), (n, self.num_topk), ("num_tokens", "num_topk")
                )
        else:
            if topk_weights is not None:
                fail("topk_weights", "weights travel only with topk_idx: a dispatch without topk_idx takes none")
            if is_token_in_rank is None and num_tokens_per_expert is None:
                fail(
                    "topk_idx",
                    "a dispatch needs topk_idx, or the routing given by is_token_in_rank and num_tokens_per_expert, "
                    "or (cached) a handle",
                )
            for name, value in (("is_token_in_rank", is_token_in_rank), ("num_tokens_per_expert", num_tokens_per_expert)):
                if value is None:
                    fail(name, "a dispatch without topk_idx (and without handle) routes by is_token_in_rank and num_tokens_per_expert: pass both")
            d_in = self._tensor(
                "is_token_in_rank", is_token_in_rank, ("bool",), (n, self.group_size), ("num_tokens", "num_ranks")
            )
            d_pe = self._tensor(
                "num_tokens_per_expert", num_tokens_per_expert, ("int32",), (self.num_experts,), ("num_experts",)
            )
        op = StreamOp(self._comm, previous_event, async_finish, allocate_on_comm_stream)
        host_sync = num_worst_tokens == 0
        self._check_graph_state(op, host_sync, zero_copy, "dispatch")
        into = num_worst_tokens >= self.capacity
        if op.capturing and not into:
            fail(
                "num_worst_tokens",
                f"inside a CUDA graph capture it must be >= {self.capacity} (num_ranks * max_tokens_per_rank) "
                f"(got {num_worst_tokens})",
            )
        op.use(x, scales, topk_idx, topk_weights)
        if d_idx is None:
            op.use(is_token_in_rank, num_tokens_per_expert)
        op.begin()
        if d_idx is None:
            layout = self._layout(n, op)
            self._session.layout_from_ranks_into((d_in.ptr, d_in.numel), (d_pe.ptr, d_pe.numel), layout.native)
            layout.topk_ptr = None
        else:
            layout = self._layout_of(is_token_in_rank, d_idx, op)
        handle_slot = None
        if host_sync:
            mode, bound, native_handle = "host_sync", 0, None
        elif into:
            handle_slot = self._handle(layout, op)
            mode, bound, native_handle = "into", 0, handle_slot.native
        else:
            mode, bound, native_handle = "bounded", num_worst_tokens, None
        out = self._session.dispatch(
            layout.native,
            (dx.ptr, dx.numel),
            None if ds is None else (ds.ptr, ds.numel),
            None if d_idx is None else (d_idx.ptr, d_idx.numel),
            None if d_w is None else (d_w.ptr, d_w.numel),
            mode,
            bound,
            native_handle,
        )
        rows = out.num_recv if host_sync else num_worst_tokens
        recv = self._outputs(op, out, rows, scales is not None, d_idx is not None, d_w is not None, zero_copy)
        if not host_sync and not zero_copy:
            self._mask_padding(self._count(out.handle, handle_slot), recv[1], recv[2], rows)
        per_expert = aligned_counts(out.per_expert, expert_alignment) if host_sync else []
        h = DispatchHandle(self, out.handle, layout, rows, out.num_recv, handle_slot)
        recv_x = recv[0] if scales is None else (recv[0], recv[3])
        return recv_x, recv[1], recv[2], per_expert, h, op.finish()

    def _cached_dispatch(self, x, handle, previous_event, async_finish, allocate_on_comm_stream, zero_copy):
        h = self._own(handle)
        x, scales, dx, ds = self._x(x, h.num_tokens)
        op = StreamOp(self._comm, previous_event, async_finish, allocate_on_comm_stream)
        self._check_graph_state(op, False, zero_copy, "cached dispatch")
        self._own(h, op)
        op.use(x, scales)
        op.begin()
        out = self._session.cached_dispatch(h._native, (dx.ptr, dx.numel), None if ds is None else (ds.ptr, ds.numel))
        recv = self._outputs(op, out, h.num_rows, scales is not None, False, False, zero_copy)
        recv_x = recv[0] if scales is None else (recv[0], recv[3])
        return recv_x, None, None, None, None, op.finish()

    def _outputs(self, op, out, rows, fp8, topk, weights, zero_copy):
        """``[recv_x, recv_topk_idx, recv_topk_weights, recv_scales]`` of a dispatch (None
        where absent), as copies or (`zero_copy`) views. The copies move the rows the device
        counted."""
        if op.capturing:
            self._captured = True
        self._latest_zero_copy = zero_copy
        x_dtype = torch.uint8 if fp8 else torch.bfloat16
        specs = [
            ("x", self.hidden, _FP8 if fp8 else torch.bfloat16, x_dtype, out.recv_x),
            ("topk_idx", self.num_topk, torch.int64, torch.int64, out.recv_topk_idx) if topk else None,
            ("topk_weights", self.num_topk, torch.float32, torch.float32, out.recv_topk_weights) if weights else None,
            ("scales", self.hidden // _FP8_BLOCK, torch.float32, torch.float32, out.recv_scales) if fp8 else None,
        ]
        if zero_copy:
            views = []
            for spec in specs:
                if spec is None:
                    views.append(None)
                    continue
                name, cols, dtype, raw_dtype, ptr = spec
                kind = f"zero-copy dispatch recv_{name}"
                v = view(
                    ptr, (min(rows, self.capacity), cols), raw_dtype, self.device, self, kind=kind, shown_dtype=dtype
                )
                views.append(v.view(dtype) if dtype != raw_dtype else v)
            return views
        results = []
        with torch.cuda.stream(op.alloc_stream()):
            for spec in specs:
                results.append(None if spec is None else torch.empty((rows, spec[1]), dtype=spec[2], device=self.device))
        with torch.cuda.stream(self._comm):
            for spec, t in zip(specs, results):
                if spec is not None:
                    self._recv(spec[0], t, spec[1], out.handle)
        op.output(*results)
        return results

    def _count_ptr(self, native_handle):
        """The device address of the int32 count of rows `native_handle`'s dispatch received."""
        return native_handle.recv_count_ptr

    def _count(self, native_handle, slot):
        """A one-element int32 view of the rows `native_handle`'s dispatch received (on the
        device); kept with the handle slot when there is one (so that a capture reuses it)."""
        if slot is not None and getattr(slot, "count", None) is not None:
            return slot.count
        count = view(self._count_ptr(native_handle), (1,), torch.int32, self.device, native_handle)
        if slot is not None:
            slot.count = count
        return count

    def _mask_padding(self, count, recv_topk_idx, recv_topk_weights, rows):
        """Rows past the received `count` (known only on the device) get -1 ids and 0
        weights."""
        if recv_topk_idx is None and recv_topk_weights is None:
            return
        with torch.cuda.stream(self._comm):
            pad = (torch.arange(rows, device=self.device, dtype=torch.int32) >= count).unsqueeze(1)
            if recv_topk_idx is not None:
                recv_topk_idx.masked_fill_(pad, -1)
            if recv_topk_weights is not None:
                recv_topk_weights.masked_fill_(pad, 0.0)

    def _own(self, handle, op=None):
        """`handle`, checked; an op being captured keeps its routing state for the Buffer's
        life (the graph reads it on every replay)."""
        if not isinstance(handle, DispatchHandle):
            fail("handle", f"must be a DispatchHandle from this Buffer's dispatch (got {type(handle).__name__})")
        if handle._buffer_id != id(self):
            fail("handle", "was produced by another Buffer")
        if op is not None and op.capturing:
            self._pin(handle._layout)
            if handle._slot is not None:
                self._pin(handle._slot)
            self._pinned.append(handle._native)
        return handle

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
        """Sends expert outputs back and sums each token's rows (DeepEP's ``combine``).

        ``x``: ``[handle.num_rows, hidden]`` bf16, one row per received row in the dispatch's
        order; ``topk_weights`` (optional): ``[handle.num_rows, num_topk]`` f32, summed the
        same way. Sums run in rank order in fp32, rounded to bf16 once. Returns
        ``(combined_x [num_tokens, hidden] bf16, combined_topk_weights or None, event)``."""
        if bias is not None:
            fail("bias", "epcomm's combine adds no bias (pass None; add it to x before combine, or to the result)")
        self._check_config(config)
        h = self._own(handle)
        d_x = self._tensor("x", x, ("bfloat16",), (h.num_rows, self.hidden), ("num_rows", "hidden"))
        d_w = None
        if topk_weights is not None:
            d_w = self._tensor(
                "topk_weights", topk_weights, ("float32",), (h.num_rows, self.num_topk), ("num_rows", "num_topk")
            )
        op = StreamOp(self._comm, previous_event, async_finish, allocate_on_comm_stream)
        self._own(h, op)
        op.use(x, topk_weights)
        op.begin()
        with torch.cuda.stream(op.alloc_stream()):
            out = torch.empty((h.num_tokens, self.hidden), dtype=torch.bfloat16, device=self.device)
            out_w = None
            if topk_weights is not None:
                out_w = torch.empty((h.num_tokens, self.num_topk), dtype=torch.float32, device=self.device)
        self._session.combine(
            h._native,
            (d_x.ptr, d_x.numel),
            None if d_w is None else (d_w.ptr, d_w.numel),
            (out.data_ptr(), out.numel()),
            None if out_w is None else (out_w.data_ptr(), out_w.numel()),
            # The receive rows were copied out (unless zero_copy): the combine may stage y over
            # them. Every rank must dispatch with the same zero_copy.
            not self._latest_zero_copy,
        )
        op.output(out, out_w)
        return out, out_w, op.finish()

    def combine_in_place(
        self, handle, reduce_weights=False, previous_event=None, async_finish=False, allocate_on_comm_stream=False
    ):
        """epcomm's extra: combine without moving ``x``. Every rank has written its expert
        output over the ``recv_x`` of its **latest** BF16 dispatch, taken with
        ``zero_copy=True`` (and, with ``reduce_weights``, its weights over
        ``recv_topk_weights``); each rank pulls its tokens' rows straight from the peers.
        ``handle`` must be that dispatch's. Returns ``(combined_x, combined_topk_weights or
        None, event)``."""
        check_bool("reduce_weights", reduce_weights)
        h = self._own(handle)
        op = StreamOp(self._comm, previous_event, async_finish, allocate_on_comm_stream)
        if op.capturing or self._captured:
            fail(
                "combine_in_place",
                "it reads the rows written over zero-copy views, which a CUDA graph replay cannot follow: not "
                "available inside a capture, nor on a Buffer that captured a dispatch",
            )
        op.begin()
        with torch.cuda.stream(op.alloc_stream()):
            out = torch.empty((h.num_tokens, self.hidden), dtype=torch.bfloat16, device=self.device)
            out_w = torch.empty((h.num_tokens, self.num_topk), dtype=torch.float32, device=self.device) if reduce_weights else None
        self._session.combine_in_place(
            h._native,
            (out.data_ptr(), out.numel()),
            None if out_w is None else (out_w.data_ptr(), out_w.numel()),
        )
        op.output(out, out_w)
        return out, out_w, op.finish()

    # ------------------------------------------------------------------------------------------
    # Low-latency (decode) ops

    def low_latency_dispatch(
        self,
        x,
        topk_idx,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        use_fp8=True,
        round_scale=False,
        use_ue8m0=False,
        async_finish=False,
        return_recv_hook=False,
        *,
        cumulative_local_expert_recv_stats=None,
        dispatch_wait_recv_cost_stats=None,
        column_major_scales=False,
    ):
        """Sends every token once to each rank holding one of its experts and packs what this
        rank received expert-major (DeepEP's ``low_latency_dispatch``). No host wait, no count
        round trip. Needs a Buffer created with ``num_max_dispatch_tokens_per_rank > 0``.

        ``x``: ``[num_tokens, hidden]`` bf16 with ``num_tokens <=
        num_max_dispatch_tokens_per_rank`` (0 allowed); ``topk_idx``: ``[num_tokens, num_topk]``
        int64 (``-1`` = none; a token names each expert at most once).
        ``num_max_dispatch_tokens_per_rank`` and ``num_experts`` must be the Buffer's.

        ``use_fp8``: rows arrive as e4m3 with one f32 scale per 128 channels (``amax = max(max
        |x|, 1e-4)``, ``scale = amax / 448``, values ``e4m3(x * 448 / amax)``);
        ``round_scale``: scales rounded up to powers of two and the values cast with them.
        Scales are ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden
        // 128]`` f32, row-major; ``column_major_scales=True``: the same shape with each
        expert's matrix stored column-major (strides ``(S * cap, 1, cap)``, DeepEP's layout,
        written so by the kernel: no copy). ``use_ue8m0=True`` (packed UE8M0 scale bytes) is
        refused: epcomm's rounded scales are f32.

        ``return_recv_hook=True``: returns after the send phase; ``hook()`` issues the receive
        phase (the outputs are filled once it ran). Until then no other op of this Buffer may
        run. ``async_finish=True``: returns an event instead of making the current stream wait
        (not together with a hook, as in DeepEP). ``cumulative_local_expert_recv_stats``
        (optional ``[num_local_experts]`` int32): the received counts are added to it.

        Returns ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` is ``[num_local_experts,
        num_ranks * num_max_dispatch_tokens_per_rank, hidden]`` bf16, or with FP8 the tuple
        ``(e4m3 rows of that shape, scales)``; for local expert ``l`` the first
        ``recv_count[l]`` rows are valid, one per (token, k) that named it, ordered by source
        rank, then source token index. ``recv_count``: ``[num_local_experts]`` int32. Both are
        views of one of the Buffer's two receive sets, valid until the second-next low-latency
        dispatch (the next one writes the other set). ``handle``: a
        :class:`LowLatencyHandle` for :meth:`low_latency_combine`; ``hook``: None unless
        ``return_recv_hook``.
        """
        return _low_latency.dispatch(
            self,
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            use_fp8,
            round_scale,
            use_ue8m0,
            async_finish,
            return_recv_hook,
            cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats,
            column_major_scales,
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
        *,
        combine_wait_recv_cost_stats=None,
    ):
        """Sends every expert output row back to its token's rank and reduces them (DeepEP's
        ``low_latency_combine``): ``combined_x[t] = sum over k with topk_idx[t, k] != -1, in
        increasing k, of topk_weights[t, k] * y_k``, in fp32 (each product and sum rounded),
        rounded to bf16 once; deterministic.

        ``x``: ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]``
        bf16, the expert outputs at the rows of ``handle``'s dispatch; ``topk_idx`` (int64) and
        ``topk_weights`` (f32): this rank's ``[num_tokens, num_topk]`` of that dispatch;
        ``out`` (optional): the ``[num_tokens, hidden]`` bf16 tensor to write. The handle is
        valid until the second-next low-latency dispatch after its own.

        ``use_logfmt`` and ``zero_copy`` are refused: epcomm sends bf16 rows and has no
        zero-copy combine buffer. ``async_finish`` and ``return_recv_hook`` as in
        :meth:`low_latency_dispatch`. Returns ``(combined_x, event, hook)``.
        """
        return _low_latency.combine(
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

    # ------------------------------------------------------------------------------------------
    # Rank masking (ll_masking=True)

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Masks (``mask=True``) or unmasks rank ``rank_to_mask`` for the low-latency ops issued
        after this call (stream-ordered; no host wait). A masked rank is sent no rows and waited
        for by nothing: a dispatch receives no rows from it, a combine adds nothing for the
        entries whose expert it holds. Unmask only a rank that ran every low-latency op in step
        with this one: a rank whose ops fell behind is masked again at the next timeout."""
        check_int("rank_to_mask", rank_to_mask)
        check_bool("mask", mask)
        self._session.ll_set_masked(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        """Writes the mask into ``mask_status`` (``[num_ranks]`` int32 on this GPU: 1 masked,
        0 not), as the ops issued so far leave it; stream-ordered (the current stream waits
        for it), no host wait. A rank is masked by the caller or by a low-latency op whose
        wait for it expired (``timeout``)."""
        d = describe("mask_status", mask_status)
        check("mask_status", d, dtypes=("int32",), shape=(self.group_size,), device=self.device, shape_names=("num_ranks",))
        op = StreamOp(self._comm, None, False, False)
        op.begin()
        self._session.ll_mask_into((d.ptr, d.numel))
        op.use(mask_status)
        op.finish()

    def low_latency_clean_mask_buffer(self):
        """Unmasks every rank (stream-ordered); the caveat of
        :meth:`low_latency_update_mask_buffer` holds for each."""
        self._session.ll_clear_mask()
