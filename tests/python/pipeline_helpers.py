"""Sources, stages and a raw channel reader for the pipeline tests. A module
of its own so that worker processes started with spawn and helper scripts
can import them."""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import signal
import sys
import time

import numpy as np
from tsock import _capi, _structure


class Numbers:
    """Sample i: a (3, 4) float32 array made from i, and the label i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return np.arange(12, dtype=np.float32).reshape(3, 4) + np.float32(i), i


class Counting(Numbers):
    """Numbers that records which samples were loaded (workers=0 only)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.loaded: list[int] = []

    def __getitem__(self, i: int):
        self.loaded.append(i)
        return super().__getitem__(i)


class Ragged(Numbers):
    """Sample 5 has another shape: collate cannot stack it."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return (x[:2] if i == 5 else x), y


def noisy(sample, rng):
    """Random numbers from the generator handed in and from Python's and
    numpy's global generators."""
    x, y = sample
    g = random.random() + float(np.random.rand())
    return x + rng.standard_normal(x.shape).astype(np.float32) + np.float32(g), y


def noisy_torch(sample, rng):
    """noisy, and torch's global generator too. The process that makes the
    pipeline must have imported torch (its workers then have it too)."""
    x, y = noisy(sample, rng)
    return x + np.float32(float(sys.modules["torch"].rand(()))), y


def fail_on_13(sample, rng):
    if sample[1] == 13:
        raise ValueError("sample 13 is bad")
    return noisy(sample, rng)


def die_on_13(sample, rng):
    if sample[1] == 13:
        os.kill(os.getpid(), signal.SIGKILL)
    return noisy(sample, rng)


def slow_on_13(sample, rng):
    if sample[1] == 13:
        time.sleep(30)
    return noisy(sample, rng)


def sleepy(sample):
    """A decode stage that takes at least 2 ms (tests/python/test_metrics.py)."""
    time.sleep(0.002)
    return sample


def make_pipeline(workers: int = 0, n: int = 60, batch_size: int = 4, **kw):
    """The pipeline the producer scripts and the tests both build."""
    import tsock

    kw.setdefault("augment", noisy)
    kw.setdefault("seed", 11)
    return tsock.Pipeline(Numbers(n), batch_size=batch_size, workers=workers, **kw)


def batch_hash(batch) -> str:
    """A hash of every leaf's bytes, in the batch's flattened order."""
    _, leaves = _structure.flatten(batch)
    h = hashlib.sha256()
    for leaf in leaves:
        arr = leaf.numpy() if hasattr(leaf, "numpy") else np.asarray(leaf)
        data = np.ascontiguousarray(arr).tobytes()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def reference(pipeline, epochs) -> list:
    """The events a reader of an uninterrupted run of `pipeline` sees: each
    batch as ("batch", epoch, index, hash), each epoch's end as ("end",)."""
    out = []
    for e in epochs:
        for info, b in pipeline.batches(e, with_info=True):
            out.append(("batch", info.epoch, info.index, batch_hash(b)))
        out.append(("end",))
    return out


class RawReader:
    """A reader through the C ABI itself: every batch's pipeline tag and a
    hash of its tensors' bytes, read in place from shared memory."""

    def __init__(self, name: str, timeout: float = 30.0):
        self.lib = _capi.load(reader_only=True)
        opts = _capi.ReaderOptions()
        self.lib.tsock_reader_options_init(ctypes.byref(opts))
        opts.attach_timeout_ns = int(timeout * 1e9)
        self.handle = ctypes.c_void_p()
        rc = self.lib.tsock_reader_attach(name.encode(), ctypes.byref(opts), ctypes.byref(self.handle))
        if rc != 0:
            raise OSError(rc, f"attach {name}: {self.lib.tsock_last_error().decode()}")

    def next(self, timeout: float = 30.0):
        """("batch", tag, hash, first values of tensor 1) | ("end",) | ("status", rc)."""
        ptr = ctypes.POINTER(_capi.Batch)()
        rc = self.lib.tsock_reader_acquire(self.handle, ctypes.byref(ptr), int(timeout * 1e9))
        if rc == _capi.EAGAIN:
            raise AssertionError(f"no batch within {timeout} s")
        if rc != 0:
            return ("status", rc)
        b = ptr.contents
        try:
            if b.flags & _capi.BATCH_EPOCH_END:
                return ("end",)
            tag = _structure.decode_tag(ctypes.string_at(b.meta, b.meta_len))
            h = hashlib.sha256()
            labels = None
            for i in range(b.n_tensors):
                t = b.tensors[i]
                data = ctypes.string_at(t.data, t.nbytes)
                h.update(len(data).to_bytes(8, "little") + data)
                if i == 1:
                    labels = np.frombuffer(data, np.int64).tolist()
            return ("batch", tag, h.hexdigest(), labels)
        finally:
            self.lib.tsock_reader_release(self.handle, ptr)

    def close(self) -> None:
        if self.handle.value is not None:
            self.lib.tsock_reader_detach(self.handle)
            self.handle.value = None


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_gone(pids, timeout: float = 20.0) -> list:
    """Waits until every pid has exited; returns those still running."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if not gone(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
