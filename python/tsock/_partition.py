"""Partition mode on the consumer's side: Consumer(rank=, world_size=) on
a channel of a tsock.Pipeline(world_size=...) takes its rank's batches and
lets the others go unread (docs/PIPELINE.md, "Partition mode"). Ranks
checks every batch's partition against the consumer's; the Consumer keeps
the epoch bookkeeping and lets go of what Ranks turns down."""

from __future__ import annotations

import numbers

from . import _structure
from ._reader import Raw
from .errors import PartitionMismatch


def check(rank, world_size) -> tuple[int | None, int | None]:
    """rank and world_size, checked: both None, or ints with
    0 <= rank < world_size <= 65535 (a tag's u16)."""
    if rank is None and world_size is None:
        return None, None
    if rank is None or world_size is None:
        raise ValueError("rank= and world_size= go together (partition mode), or neither is given")
    for what, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{what} must be an int, got {v!r}")
    if not 1 <= world_size <= 65535 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size <= 65535, got rank={rank}, world_size={world_size}")
    return int(rank), int(world_size)


class Ranks:
    """Which batches of channel `name` are this consumer's: all of them when
    neither it nor the channel is partitioned, else those of its rank."""

    def __init__(self, name: str, rank: int | None, world_size: int | None):
        self.name, self.rank, self.world_size = name, rank, world_size
        #: ranks whose batches the channel carries (from the tags; 1 when not partitioned)
        self.ranks = 1
        self._others = 0  # other ranks' batches since this rank's last

    def mine(self, raw: Raw) -> bool:
        """Whether raw (a batch, not a marker) is for this consumer; marks
        it foreign if not. PartitionMismatch when the channel's partitioning
        does not fit the consumer's, CorruptSegment when its tag cannot be
        one. Each step of an epoch carries one batch of each rank the
        channel makes, in a fixed order, so that many batches in a row for
        other ranks mean this rank is not made at all: an error rather than
        a wait for ever."""
        if self._rank_of(raw) == (self.rank or 0):
            self._others = 0
            return True
        raw.foreign = True
        self._others += 1
        if self._others >= self.ranks:
            raise PartitionMismatch(
                f"channel '{self.name}' carries the batches of {self.ranks} of its {self.world_size} ranks, not "
                f"those of rank {self.rank}: its producer makes another node's share (Pipeline(ranks=...))"
            )
        return False

    def _rank_of(self, raw: Raw) -> int:
        """The rank raw is for (0 on a channel that is not partitioned),
        once the channel's partitioning is checked against this consumer's."""
        found = _structure.partition(raw.meta)
        world = found[1] if found is not None else 0
        if world and self.rank is None:
            raise PartitionMismatch(
                f"channel '{self.name}' is partitioned among {world} ranks (a tsock.Pipeline with world_size="
                f"{world}): open it with Consumer('{self.name}', rank=<this process's rank>, world_size={world})"
            )
        if self.rank is not None and not world:
            raise PartitionMismatch(
                f"channel '{self.name}' is not partitioned (its producer is not a tsock.Pipeline with world_size=): "
                "open it without rank= and world_size="
            )
        if world != (self.world_size or 0):
            raise PartitionMismatch(
                f"channel '{self.name}' is partitioned among {world} ranks, not world_size={self.world_size}: "
                "it serves another job"
            )
        if not world:
            return 0
        self.ranks = found[2]
        return found[0]
