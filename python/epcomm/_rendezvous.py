"""How the ranks of a Buffer find each other: through a ``torch.distributed`` process group
(every rank learns its host-local rank from the hostnames; the group's rank 0 picks a free TCP
port for epcomm's coordinator and broadcasts its address), or through the launcher's
environment variables when there is no group."""

import os
import socket

from ._args import fail

#: Overrides the address the other ranks use to reach the group's rank 0.
MASTER_ADDR_ENV = "EPCOMM_MASTER_ADDR"


def local_ranks(hosts, rank):
    """``(local_rank, local_world_size)`` of `rank` given every rank's hostname. epcomm's world
    layout numbers ranks host by host, so each host's ranks must be consecutive and every host
    must have as many."""
    world = len(hosts)
    per_host = hosts.count(hosts[0])
    if world % per_host != 0:
        fail("group", f"every host must run as many ranks (hosts of the group: {hosts})")
    for start in range(0, world, per_host):
        block = hosts[start : start + per_host]
        if len(set(block)) != 1 or block[0] in hosts[:start]:
            fail("group", f"each host's ranks must be consecutive, {per_host} per host (hosts of the group: {hosts})")
    return rank % per_host, per_host


def _free_port(bind_to):
    """A TCP port that is free on `bind_to` (an IPv4 address, "" for every interface) now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((bind_to, 0))
        return s.getsockname()[1]


def from_group(group, timeout):
    """The bootstrap tuple of the native Session for this rank of `group` (collective over
    it): ``(master_addr, master_port, rank, world_size, local_rank, local_world_size,
    timeout)``."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    local_rank, local_world = local_ranks(hosts, rank)
    addr = [None, None]
    if rank == 0:
        master = os.environ.get(MASTER_ADDR_ENV) or ("127.0.0.1" if local_world == world else hosts[0])
        bind_to = "127.0.0.1" if master == "127.0.0.1" else ""
        addr = [master, _free_port(bind_to)]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(addr, src=src, group=group)
    return (addr[0], int(addr[1]), rank, world, local_rank, local_world, float(timeout))
