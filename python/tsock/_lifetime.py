"""When a batch the consumer has read goes back to the producer.

Consumer(lifetime=...) picks one of two policies:

Referenced (the default): a batch stays valid for as long as anything refers
to it. In `for x, y in consumer:` the loop variables still refer to batch n
while next() takes batch n+1 (they are rebound only after it returns), so at
each next() what can be known is whether the batches before are still
referenced. They go back to the producer once nothing refers to them any
more; a referenced one is held in the ring, and when the ring has no room
left for holding it (see `limit`) it is kept: the bytes of its referenced
tensors are copied into private memory swapped in under the same addresses
(tsock_batch_keep), and its slot goes back. The common loop (nothing kept)
thus holds two batches and copies nothing; a batch kept for good costs one
copy of the tensors that are kept, made once.

What refers to a leaf: for numpy, the arrays built over a per-leaf
memoryview (the exporter, whose reference count says whether any array of
it is alive); for torch, JAX and DLPack consumers, the DLPack descriptors
(counted by the C library per tensor, read here from memory without a call:
Memory.live); for output="dlpack", also the DLPackTensor objects not yet
consumed.

Step (lifetime="step", and every output that copies): a batch goes back as
soon as the consumer has delivered all of it, when the next batch is taken;
what the caller kept of it may then change. No bookkeeping at all.
"""

from __future__ import annotations

import os
import sys

from . import _capi
from ._reader import LIVE_TOTAL, Raw, Reader
from .errors import TsockError

# The most batches held in the ring, referenced or not: the C reader's
# max_held (each held batch is a struct of the reader's that the loop
# cycles through: few stay in cache).
HOLD_MAX = 8

_refcount = sys.getrefcount


def _count_in_loop(ex: list) -> int:
    """The reference count the loops below see for the one exporter in ex,
    measured with the same code shape (a list, iterated by a for loop, the
    loop variable passed to getrefcount)."""
    for e in ex:
        return _refcount(e)
    return 0


def _calibrate() -> int:
    """References to an exporter when nothing outside refers to it: the
    Raw's list, the loop variable and getrefcount's argument on CPython up
    to 3.13 (3). Measured, not assumed: an interpreter that borrows the loop
    variable's reference (CPython 3.14's stack references) or counts
    differently would otherwise make a referenced batch look free, and the
    producer would overwrite it under the trainer. Refuses to run where one
    outside reference does not show."""
    ex = [memoryview(b"tsock")]
    alone = _count_in_loop(ex)
    held = ex[0]
    with_one = _count_in_loop(ex)
    del held
    if with_one <= alone:
        raise ImportError(
            "tsock: this Python's reference counts do not show whether a batch is still referenced "
            f"({alone} with no reference, {with_one} with one); lifetime='referenced' cannot work here"
        )
    return alone


# The loops below iterate the list itself: an iterator of pairs would hold
# one more reference.
_UNREFERENCED = _calibrate()


def _by_exporters(raw: Raw) -> bool:
    """numpy: an array of a leaf is alive (None: a leaf without exporter,
    whose huge count reads as referenced: when in doubt, keep)."""
    ex = raw.exporters
    if ex is not None:
        for e in ex:
            if _refcount(e) > _UNREFERENCED:
                return True
    return False


def _by_descriptors(raw: Raw) -> bool:
    """torch, JAX: a DLPack descriptor of a leaf is alive (the tensor, the
    JAX array, or a computation JAX dispatched on it)."""
    live = raw.mem.live
    return live is not None and live[LIVE_TOTAL] != 0


def _by_both(raw: Raw) -> bool:
    """DLPack objects: one not yet consumed (after the leaves' places, None
    for this output), or a descriptor made from one."""
    if _by_descriptors(raw):
        return True
    ex = raw.exporters
    if ex is not None:
        for e in ex:
            if e is not None and _refcount(e) > _UNREFERENCED:
                return True
    return False


REFERENCED = {"numpy": _by_exporters, "torch": _by_descriptors, "jax": _by_descriptors, "dlpack": _by_both}


def _referenced_mask(raw: Raw) -> int:
    """Leaves referenced through exporters (C adds those with DLPack
    descriptors alive). Raw.exporters: the memoryview of leaf p at position
    p, then DLPackTensor objects (leaf in their `leaf`)."""
    mask = 0
    ex = raw.exporters
    n = len(raw.leaves)
    if ex is not None:
        for p in range(len(ex)):
            e = ex[p]
            if e is not None and _refcount(e) > _UNREFERENCED:
                mask |= 1 << (p if p < n else e.leaf)
    return mask


class Step:
    """Releases a batch once the consumer is done with it (Raw.done: the
    consumer releases it then itself, for speed)."""

    keeping = False

    def __init__(self, reader: Reader):
        self.reader = reader

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


class Referenced:
    """Releases a batch once the consumer is done with it and nothing refers
    to it; keeps (copies out) the oldest referenced one when the ring has
    no room left to hold it."""

    keeping = True

    def __init__(self, reader: Reader, output: str, device: bool = False):
        self.reader = reader
        self.limit = 0  # batches held at most: known at the first batch
        # Partition mode: ranks whose batches the channel carries (the
        # consumer sets it from the tags) and the C reader's max_held. The
        # limit then counts this rank's batches only: the others' are let
        # go unread, but one still referenced holds those after it.
        self.ranks = 1
        self.max_held = HOLD_MAX
        self.kept = 0  # batches kept (copied out), for tests and figures
        # What can refer to a batch depends on what the output made of it:
        # numpy arrays (exporters) or DLPack descriptors, never both but for
        # output="dlpack" (objects, then descriptors made from them).
        self._referenced = REFERENCED[output]
        # Device memory (output="dlpack" with a device) cannot be kept.
        self._device = device
        self._pid = os.getpid()

    def _set_limit(self, raw: Raw) -> int:
        # At most half the ring (at least 2, at most HOLD_MAX, never more
        # than the ring): what is held here, the producer cannot fill. In
        # partition mode each batch of this rank held holds a step of
        # batches: the same share of the ring, and of max_held.
        slots = max(1, self.reader.length // raw.mem.length)
        per = self.ranks
        if per == 1:
            self.limit = min(slots, HOLD_MAX, max(2, slots // 2))
        else:  # 1: a ring too small for this many ranks keeps (copies) at every step
            self.limit = max(1, min(HOLD_MAX, slots // (2 * per), min(self.max_held, slots) // per))
        return self.limit

    def settle(self) -> None:
        """Before a batch is acquired: releases the delivered batches that
        nothing refers to, and keeps the oldest referenced ones while there
        is no room for one more batch. A batch can be released only once
        every batch before it is (the ring's cursor), so a referenced batch
        holds those after it in the ring until it is released or kept."""
        held = self.reader.held
        left = len(held)
        if left == 2 and self.limit and self.ranks == 1:
            # The plain loop: the batch before, then the loop variables'
            # (looked at next time; held while there is room, which there
            # is: a limit is at least 2).
            old = held[0]
            if old.done and held[1].done and not self._referenced(old):
                self.reader.release(old)
                return
        if not left:
            return
        limit = self.limit or self._set_limit(held[0])
        if self.ranks > 1:
            left = sum(1 for raw in held if not raw.foreign)
        referenced = self._referenced
        last = None
        for raw in held:
            if not raw.done:
                break
            if not raw.lease.kept and referenced(raw):  # kept: its memory is private already
                if left < limit:
                    break
                self._keep(raw)
            last = raw
            left -= not raw.foreign
        if last is not None:
            self.reader.release(last)

    def _keep(self, raw: Raw) -> None:
        if self._device:
            raise TsockError(
                f"output='dlpack' with a device: {self.limit} batches are still referenced (their DLPackTensor "
                "objects, or arrays made from them), and the producer's device memory they lie in cannot be kept "
                "beyond them: copy what you keep (e.g. cupy.array(x, copy=True)) or drop it",
                _capi.ESTATE,
            )
        self.reader.keep(raw, _referenced_mask(raw))
        self.kept += 1

    def close(self) -> None:
        """Before detaching: keeps every held batch something still refers
        to (its memory then outlives the consumer, unchanged). Tries them
        all, then raises the first error."""
        if self._device or os.getpid() != self._pid:
            # A forked child cannot keep: the reader and its slots are the
            # parent's (batches kept before the fork are its own copies).
            return
        error = None
        # Under the reader's lock: a thread still reading (a daemon thread
        # at exit) cannot release a batch between the look and the keep.
        with self.reader.busy:
            for raw in list(self.reader.held):
                if raw.lease.kept or not raw.lease.valid or not _by_both(raw):
                    continue
                try:
                    self._keep(raw)
                except Exception as e:  # noqa: BLE001 - raised below, after the others
                    error = error or e
        if error is not None:
            raise error
