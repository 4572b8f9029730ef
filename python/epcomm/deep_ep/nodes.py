"""Which ranks of a ``deep_ep.Buffer``'s group form a node, and the transports its cores get
(torch-free, so that the rules are testable anywhere).

DeepEP V1 splits a group of more than 8 ranks into nodes of 8 NVLink peers and runs its
internode kernels (RDMA between nodes, NVLink inside one) on it. Here a node is:

* by default, a **host**: the ranks sharing a hostname (each host's ranks consecutive, as many
  on every host; :func:`epcomm._rendezvous.local_ranks`); a group on one host is one node, the
  intranode case, which stays exactly as it was;
* with ``EPCOMM_DEEP_EP_NODE_SIZE=L`` set (the same on every rank), a **logical node** of ``L``
  consecutive ranks: each host's ranks are split into ``ranks per host / L`` nodes (``L`` must
  divide them). This is how a group on one host, even ranks sharing one GPU, runs DeepEP's
  internode path: 4 ranks with ``EPCOMM_DEEP_EP_NODE_SIZE=2`` are 2 nodes x 2.

A group of several nodes runs its normal ops on a two-tier ``epcomm.Buffer`` (a rail between
nodes, then NVLink inside each). Its transport: the Buffer's ``transport=`` when given, else
``EPCOMM_DEEP_EP_TRANSPORT`` (``nvshmem``, ``proxy-ce``, ``proxy-verbs``), else ``nvshmem``;
``:vnodes=V`` (``V`` = ranks per host / ``L``) is added when logical nodes split a host, and a
``vnodes`` already in the spec must say the same. ``ipc`` cannot cross nodes: refused naming
``transport``. The low-latency core (a flat Buffer over the whole group) gets ``transport=``
when given, else ``ipc`` on one host, else the internode transport without options.
"""

from .._args import fail

#: Ranks per logical node (an int dividing the ranks per host); unset: one node per host.
NODE_SIZE_ENV = "EPCOMM_DEEP_EP_NODE_SIZE"
#: The transport of the two-tier core when ``transport=`` is not given (default ``nvshmem``).
TRANSPORT_ENV = "EPCOMM_DEEP_EP_TRANSPORT"
#: The internode transport when neither ``transport=`` nor :data:`TRANSPORT_ENV` names one.
DEFAULT_INTERNODE_TRANSPORT = "nvshmem"


class NodePlan:
    """The split of a group into nodes: ``node_size`` ranks per node (rank ``r`` is local rank
    ``r % node_size`` of node ``r // node_size``), ``num_nodes``, ``internode`` (more than one
    node), ``transport`` (the normal core's spec; two-tier when ``internode``) and
    ``ll_transport`` (the low-latency core's)."""

    def __init__(self, world, node_size, transport, ll_transport):
        self.world = world
        self.node_size = node_size
        self.num_nodes = world // node_size
        self.internode = self.num_nodes > 1
        self.transport = transport
        self.ll_transport = ll_transport

    def __repr__(self):
        return (
            f"NodePlan({self.num_nodes} node(s) x {self.node_size} rank(s), transport={self.transport!r}, "
            f"ll_transport={self.ll_transport!r})"
        )


def _parse(spec, argument):
    """The canonical form of transport spec `spec` (an error naming `argument` otherwise)."""
    from .. import parse_transport

    if not isinstance(spec, str):
        fail(argument, f"must be a str (got {spec!r})")
    try:
        return parse_transport(spec)
    except ValueError as e:
        fail(argument, f"is not a transport spec epcomm knows ({e})")


def split_spec(spec):
    """``(backend, vnodes)`` of a canonical transport spec: ``vnodes`` is None (no such
    option), an int, or ``"max"``."""
    backend, _, options = spec.partition(":")
    vnodes = None
    for opt in options.split(",") if options else ():
        key, _, value = opt.partition("=")
        if key.strip() == "vnodes":
            value = value.strip()
            vnodes = value if value == "max" else int(value)
    return backend, vnodes


def node_size_from_env(env, per_host):
    """``EPCOMM_DEEP_EP_NODE_SIZE`` from `env` (None when unset or empty), checked: a positive
    int dividing the ranks per host."""
    raw = env.get(NODE_SIZE_ENV, "")
    if not raw.strip():
        return None
    try:
        size = int(raw)
    except ValueError:
        fail(NODE_SIZE_ENV, f"must be a number of ranks per logical node (got {raw!r})")
    if size < 1 or per_host % size != 0:
        fail(
            NODE_SIZE_ENV,
            f"must be a positive number of ranks dividing the {per_host} rank(s) per host (got {size}): a logical "
            "node never spans hosts",
        )
    return size


def plan(world, per_host, transport, env):
    """The :class:`NodePlan` of a group of `world` ranks, `per_host` per host, whose Buffer got
    ``transport=`` `transport` (None: not given; else a canonical spec), with the environment
    `env` (a mapping; :data:`NODE_SIZE_ENV`, :data:`TRANSPORT_ENV`). Every rank computes the
    same plan from the same inputs (raises the same refusal on every rank)."""
    node_size = node_size_from_env(env, per_host)
    if node_size is None:
        node_size = per_host
    if node_size >= world:
        # One node: the intranode case, as before (ipc unless the Buffer names a transport).
        spec = "ipc" if transport is None else transport
        return NodePlan(world, world, spec, spec)
    vnodes = per_host // node_size
    if transport is not None:
        spec, source = transport, "transport"
    else:
        spec = env.get(TRANSPORT_ENV, "").strip() or DEFAULT_INTERNODE_TRANSPORT
        source = TRANSPORT_ENV
        spec = _parse(spec, source)
    backend, given = split_spec(spec)
    nodes = world // node_size
    if backend == "ipc":
        fail(
            source,
            f"ipc reaches the ranks of one node only, and this group is {nodes} nodes x {node_size} ranks: name a "
            f"transport that crosses nodes (nvshmem, proxy-ce, proxy-verbs; {TRANSPORT_ENV} when transport= is "
            "not given)",
        )
    if given is None:
        if vnodes > 1:
            spec = _parse(f"{spec}:vnodes={vnodes}", source)
    else:
        said = per_host if given == "max" else given
        if said != vnodes:
            fail(
                source,
                f"{spec} splits each host's {per_host} ranks into {said} logical node(s), but the nodes of this "
                f"group have {node_size} ranks ({vnodes} per host; {NODE_SIZE_ENV} or the hosts decide it): "
                f"leave vnodes out, or make it vnodes={vnodes}",
            )
    if transport is not None:
        ll = transport
    elif per_host == world:
        ll = "ipc"
    else:
        ll = _parse(backend, source)
    return NodePlan(world, node_size, spec, ll)
