"""How a Consumer cuts the producer's batches into the batches it delivers.

Two cutters, one interface: ``next(epoch)`` gives the next delivered batch
of the epoch in progress (None at its end), ``drop(epoch)`` lets go of the
producer batch in progress when the rest of an epoch is dropped,
``forget()`` stops referring to it at close. They read producer batches
from ``epoch``, the consumer (``_take(rows_so_far)``, None at the epoch's
end; ``_release(raw)``), handed in at each call rather than kept: a cutter
that referred to its consumer would make a cycle, and a consumer dropped
without close() would stay attached (holding the producer back) until the
cyclic garbage collector ran. They make leaves with the consumer's output
(``view``, ``owned``, ``storage_dtype``): the epoch bookkeeping stays in
the Consumer, where a batch lives (host, pinned, device) in the output
(_placement.py).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ._output import NumpyOutput, numpy_view
from ._reader import CODE, SHAPE, Raw, Reader


class Epoch(Protocol):
    """What a cutter reads producer batches from (the Consumer)."""

    def _take(self, rows_so_far: int) -> Raw | None: ...

    def _release(self, raw: Raw | None) -> None: ...

    def _first_row(self) -> int: ...


class Whole:
    """The producer's batches as they come (batch_size=None)."""

    def __init__(self, out, reader: Reader):
        self._out, self._reader = out, reader
        self._cur: Raw | None = None  # the batch last delivered

    def next(self, epoch: Epoch):
        # The previous batch is the caller's no longer: free its slot first.
        epoch._release(self._cur)
        self._cur = None
        raw = epoch._take(0)
        if raw is None:
            return None
        self._cur = raw
        out, reader = self._out, self._reader
        if type(out) is NumpyOutput:
            leaves = out.views(reader, raw)
        else:
            leaves = [out.view(reader, raw, i) for i in range(len(raw.leaves))]
        return raw.layout.build(leaves)

    def drop(self, epoch: Epoch) -> bool:
        """Lets go of the batch in progress; whether the epoch's end was
        already read (never, for whole batches)."""
        epoch._release(self._cur)
        self._cur = None
        return False

    def forget(self) -> None:
        self._cur = None


class Rebatched:
    """Batches of batch_size samples, every leaf cut along its first
    dimension: zero-copy slices inside one producer batch, copies where a
    batch straddles two. Every sample once per epoch, in order."""

    def __init__(self, out, reader: Reader, batch_size: int, drop_last: bool):
        self._out, self._reader = out, reader
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._cur: Raw | None = None  # batch the last delivered rows came from
        self._off = 0  # rows of _cur already delivered
        self._end_pending = False  # the epoch ended after a partial batch was delivered

    def next(self, epoch: Epoch):
        if self._end_pending:
            self._end_pending = False
            return None
        size = self.batch_size
        cur = self._cur
        if cur is not None and self._off >= self.rows(cur):
            epoch._release(cur)
            cur = self._cur = None
        if cur is None:
            cur = epoch._take(0)
            if cur is None:
                return None
            self._cur, self._off = cur, epoch._first_row()
        avail = self.rows(cur) - self._off
        if avail >= size:
            # Inside one producer batch: zero-copy slices.
            start = self._off
            self._off += size
            out, reader = self._out, self._reader
            return cur.layout.build([out.view(reader, cur, i, start, start + size) for i in range(len(cur.leaves))])
        return self._gather(epoch, cur, avail, size)

    def drop(self, epoch: Epoch) -> bool:
        """Lets go of the batch in progress; whether the epoch's end was
        already read (with the last, partial batch)."""
        end_seen, self._end_pending = self._end_pending, False
        epoch._release(self._cur)
        self._cur, self._off = None, 0
        return end_seen

    def forget(self) -> None:
        self._cur = None

    def rows(self, raw: Raw) -> int:
        """Rows (samples) of a producer batch: the shared first dimension."""
        if raw.rows is not None:
            return raw.rows
        leaves = raw.leaves
        if not leaves:
            return 0
        n = None
        for i, leaf in enumerate(leaves):
            if not leaf[SHAPE]:
                raise ValueError(
                    f"batch_size={self.batch_size} needs tensors with a batch dimension; tensor {i} is 0-d"
                )
            if n is None:
                n = leaf[SHAPE][0]
            elif leaf[SHAPE][0] != n:
                raise ValueError(
                    f"batch_size={self.batch_size} cuts every tensor along its first dimension, but tensor {i} "
                    f"has {leaf[SHAPE][0]} rows and tensor 0 has {n}"
                )
        raw.rows = n
        return n

    def _gather(self, epoch: Epoch, cur: Raw, avail: int, size: int):
        """A batch that straddles producer batches: copied, piece by piece,
        releasing each producer batch once copied."""
        layout = cur.layout
        bufs = []
        for leaf in cur.leaves:
            bufs.append(np.empty((size,) + tuple(leaf[SHAPE][1:]), self._out.storage_dtype(leaf[CODE])))
        codes = [leaf[CODE] for leaf in cur.leaves]
        _copy_rows(cur, self._off, self._off + avail, bufs, codes, 0)
        filled = avail
        epoch._release(cur)
        self._cur = None
        while filled < size:
            raw = epoch._take(filled)
            if raw is None:
                break
            if raw.layout.spec != layout.spec or len(raw.leaves) != len(bufs):
                raise ValueError(
                    "cannot re-batch across producer batches of different structure "
                    f"({layout.spec} vs {raw.layout.spec})"
                )
            n = self.rows(raw)
            take = min(n, size - filled)
            _copy_rows(raw, 0, take, bufs, codes, filled)
            filled += take
            if take < n:
                self._cur, self._off = raw, take
            else:
                epoch._release(raw)
        if filled < size:
            # The epoch ended inside this batch.
            self._end_pending = True
            if self.drop_last or filled == 0:
                self._end_pending = False
                return None
            bufs = [b[:filled] for b in bufs]
        return layout.build([self._out.owned(b, leaf[CODE]) for b, leaf in zip(bufs, cur.leaves)])


def _copy_rows(raw: Raw, start: int, stop: int, bufs: list, codes: list, at: int) -> None:
    """Copies rows [start, stop) of every leaf of raw into bufs at row `at`."""
    for i, (leaf, buf, code) in enumerate(zip(raw.leaves, bufs, codes)):
        if leaf[CODE] != code:
            raise ValueError(f"cannot re-batch tensor {i}: its dtype changes between producer batches")
        if tuple(leaf[SHAPE][1:]) != buf.shape[1:]:
            raise ValueError(
                f"cannot re-batch tensor {i}: its rows have shape {tuple(leaf[SHAPE][1:])} in one producer batch "
                f"and {buf.shape[1:]} in another"
            )
        src = numpy_view(raw.mem, leaf, buf.dtype, start, stop)
        buf[at : at + stop - start] = src
