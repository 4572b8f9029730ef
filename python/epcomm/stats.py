"""Per-op wait attribution: who waited for whom in the last op (``Buffer.last_op_stats``)."""

from dataclasses import dataclass
from typing import List

__all__ = ["OpStats"]


@dataclass(frozen=True)
class OpStats:
    """What every rank measured, on its own GPU's clock, in the last op (durations in
    seconds). ``waits[q][p]``: how long after rank ``q`` started the op everything it needed
    from rank ``p`` had arrived. ``late_rank``: the rank the others waited for longest;
    ``skew``: that longest wait. ``str()`` gives the library's report."""

    op: str
    op_seq: int
    rank: int
    total: float
    sending: float
    waits: List[List[float]]
    late_rank: int
    skew: float
    text: str

    def waited_for(self, peer):
        """How long this rank waited for `peer`."""
        return self.waits[self.rank][peer]

    def __str__(self):
        return self.text
