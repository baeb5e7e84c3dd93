"""soak_reader.py - the Python reader of the chaos soak (tests/soak), the twin
of creader/soak_reader.c. It reads the test stream of internal/batchgen through
ctypes (tsock._capi, libtsock_reader.so), verifies every batch, and survives its
producer: on "producer gone" it reports and attaches again (to the producer
that replaces it).

Run by the soak with the project's venv python, PYTHONPATH=python and
TSOCK_LIBRARY_DIR=<folder of libtsock_reader.so>.

Usage: soak_reader.py NAME SLOW_US [fork=EVERY_MS:LIFE_MS]
  Attaches with TSOCK_START_NOW (waiting up to 30 s for the channel) and
  holds each batch SLOW_US microseconds. With "fork=", right after each
  attach and then every EVERY_MS while attached it forks a child that sleeps
  LIFE_MS without exec and exits (as a DataLoader worker or a helper does):
  the child inherits the reader's mapping and must not keep the reader
  "alive" once the soak kills the reader.

The producer of incarnation K publishes data batches i = K<<40, K<<40+1, ...
Within one attachment every batch must follow the previous one (seq + 1, and
i + 1 for data batches); a new attachment must come from a later incarnation
than the last one. Output lines (stdout), as the C reader's:
  attached
  forked pid=<child>
  progress n=<data batches verified by this process>
  gone inc=<K or -1> last_seq=<last seq acquired in the attachment or -1> mono=<CLOCK_MONOTONIC ns
       when acquire returned TSOCK_EPRODUCER_GONE> drained=<CLOCK_MONOTONIC ns when the last batch was
       released, or of the attach>
  closed n=<N>      (the channel was closed; exit 0)
  detached n=<N>    (SIGTERM; exit 0)
  MISMATCH ...      (exit 2)
  error ...         (exit 1)
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import numpy as np
from tsock import _capi as C

FNV_BASIS = 14695981039346656037
FNV_PRIME = 1099511628211
MASK64 = (1 << 64) - 1
MAX_LEN = 60000

# Byte j of tensor 0 is (i*31 + j*7) ^ (j >> 8), truncated to 8 bits: only
# the low 8 bits of each term matter.
_J = np.arange(MAX_LEN, dtype=np.uint64)
_J7 = ((_J * np.uint64(7)) & np.uint64(0xFF)).astype(np.uint8)
_JSH = ((_J >> np.uint64(8)) & np.uint64(0xFF)).astype(np.uint8)

_term = False


def _on_term(signum, frame):
    global _term
    _term = True


def out(line: str) -> None:
    print(line, flush=True)


class Mismatch(Exception):
    pass


def fnv1a(data: bytes) -> int:
    h = FNV_BASIS
    for c in data:
        h = ((h ^ c) * FNV_PRIME) & MASK64
    return h


def verify(b: C.Batch) -> int:
    """Checks one data batch of the batchgen format (batchgen.h); returns i."""
    if b.n_tensors != 2:
        raise Mismatch("tensor count is not 2")
    t0, t1 = b.tensors[0], b.tensors[1]
    if t0.dtype != C.DTYPE_UINT8 or t0.ndim != 1 or t0.offset != 0 or t0.strides[0] != 1:
        raise Mismatch("tensor 0 is not UINT8 [L] at offset 0")
    if t1.dtype != C.DTYPE_INT64 or t1.ndim != 1 or t1.shape[0] != 2 or t1.nbytes != 16:
        raise Mismatch("tensor 1 is not INT64 [2]")
    v = ctypes.cast(t1.data, ctypes.POINTER(ctypes.c_int64))
    i, l1 = v[0] & MASK64, v[1]
    length = t0.shape[0]
    if length != 1 + (i * 7919) % 60000 or l1 != length or t0.nbytes != length:
        raise Mismatch(f"i={i}: L={length}, tensor 1 says L={l1}")
    if t1.offset != (length + 7) // 8 * 8:
        raise Mismatch("tensor 1 offset is not (L+7)/8*8")
    data = ctypes.string_at(t0.data, length)
    got = np.frombuffer(data, dtype=np.uint8)
    want = (_J7[:length] + np.uint8((i * 31) & 0xFF)) ^ _JSH[:length]
    bad = np.flatnonzero(got != want)
    if bad.size:
        j = int(bad[0])
        raise Mismatch(f"i={i}: byte {j} is {int(got[j])}")
    if b.meta_len != 8:
        raise Mismatch("meta is not 8 bytes")
    meta = int.from_bytes(ctypes.string_at(b.meta, 8), "little")
    h = fnv1a(data)
    if meta != h:
        raise Mismatch(f"i={i}: meta {meta:016x}, FNV of tensor 0 {h:016x}")
    return i


def child_sleeps(lib: ctypes.CDLL, r: ctypes.c_void_p, life_s: float) -> None:
    """In a forked child: what a helper that never calls tsock does, plus one
    check that the parent's reader handle refuses to work here."""
    try:
        bp = ctypes.POINTER(C.Batch)()
        if lib.tsock_reader_acquire(r, ctypes.byref(bp), 0) != C.EFORKED:
            os.write(1, b"error forked child: the parent's reader handle did not return EFORKED\n")
        # Let go of the soak's pipes: only the mapping tsock leaves us remains.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        time.sleep(life_s)
    finally:
        os._exit(0)


def parse_fork(arg: str) -> tuple[float, float]:
    """fork=EVERY_MS:LIFE_MS -> (every, life) in seconds."""
    every, life = arg.removeprefix("fork=").split(":")
    if not arg.startswith("fork=") or int(every) <= 0 or int(life) < 0:
        raise ValueError(arg)
    return int(every) / 1e3, int(life) / 1e3


def main(argv: list[str]) -> int:
    try:
        if len(argv) not in (3, 4):
            raise ValueError("arguments")
        fork_every, fork_life = parse_fork(argv[3]) if len(argv) == 4 else (0.0, 0.0)
        name = argv[1].encode()
        slow_s = int(argv[2]) / 1e6
    except ValueError:
        print(f"usage: {argv[0]} NAME SLOW_US [fork=EVERY_MS:LIFE_MS]", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _on_term)
    try:
        lib = C.load(reader_only=True)
    except OSError as e:
        out(f"error load: {e}")
        return 1

    def err(what: str, rc: int) -> int:
        out(f"error {what}: {lib.tsock_status_str(rc).decode()}: {(lib.tsock_last_error() or b'').decode()}")
        return 1

    opts = C.ReaderOptions()
    lib.tsock_reader_options_init(ctypes.byref(opts))
    opts.start = C.START_NOW
    opts.attach_timeout_ns = 30 * 1_000_000_000

    n = 0
    last_progress = 0
    prev_inc = -1  # incarnation of the previous attachment
    while True:
        r = ctypes.c_void_p()
        rc = lib.tsock_reader_attach(name, ctypes.byref(opts), ctypes.byref(r))
        if rc != C.OK:
            return err("attach", rc)
        out("attached")
        next_fork = time.monotonic()  # the first child right after each attach
        drained_at = time.monotonic_ns()
        last_seq = last_i = None
        bp = ctypes.POINTER(C.Batch)()
        while True:
            if _term:
                lib.tsock_reader_detach(r)
                out(f"detached n={n}")
                return 0
            if fork_every > 0 and time.monotonic() >= next_fork:
                next_fork = time.monotonic() + fork_every
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    child_sleeps(lib, r, fork_life)
                out(f"forked pid={pid}")
            now = time.monotonic_ns()
            if now - last_progress >= 250_000_000:
                last_progress = now
                out(f"progress n={n}")
            rc = lib.tsock_reader_acquire(r, ctypes.byref(bp), 100_000_000)
            if rc == C.EAGAIN:
                continue
            if rc == C.EPRODUCER_GONE:
                gone_at = time.monotonic_ns()  # CLOCK_MONOTONIC, as the soak's clock
                break
            if rc == C.ECLOSED:
                lib.tsock_reader_detach(r)
                out(f"closed n={n}")
                return 0
            if rc != C.OK:
                return err("acquire", rc)
            b = bp.contents
            try:
                if last_seq is not None and b.seq != last_seq + 1:
                    raise Mismatch(f"seq {b.seq} follows seq {last_seq}")
                last_seq = b.seq
                if b.flags & C.BATCH_EPOCH_END:
                    if b.n_tensors != 0:
                        raise Mismatch("epoch-end marker with tensors")
                else:
                    i = verify(b)
                    if last_i is not None and i != last_i + 1:
                        raise Mismatch(f"i={i} follows i={last_i}")
                    if last_i is None and prev_inc >= 0 and (i >> 40) <= prev_inc:
                        raise Mismatch(f"attached to incarnation {i >> 40} after incarnation {prev_inc}")
                    last_i = i
                    n += 1
            except Mismatch as e:
                out(f"MISMATCH batch seq={b.seq}: {e}")
                return 2
            if slow_s > 0:
                time.sleep(slow_s)
            rc = lib.tsock_reader_release(r, bp)
            if rc != C.OK:
                return err("release", rc)
            drained_at = time.monotonic_ns()
        # Producer gone: everything it published was read. Report, attach again.
        inc = last_i >> 40 if last_i is not None else -1
        out(f"gone inc={inc} last_seq={last_seq if last_seq is not None else -1} mono={gone_at} drained={drained_at}")
        if inc >= 0:
            prev_inc = inc
        lib.tsock_reader_detach(r)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
