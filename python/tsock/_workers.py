"""The worker processes of a Pipeline.

Each worker computes whole batches (Stages.batch) for the tasks the parent
sends it and writes the arrays of each batch into one of its staging
buffers: memfd files the worker creates (anonymous memory: nothing is left
in /dev/shm or anywhere else, whatever dies), mapped by both processes. The
parent receives a small message per batch (the batch's structure with its
arrays replaced by placeholders, and where each array lies) and a buffer's
file descriptor the first time it is used or after it grew (SCM_RIGHTS over
the task pipe). The arrays of a batch are thus copied once in the worker and
never pickled; the parent reads them in place until it releases the buffer.

The parent hands out batches in task order whatever order the workers finish
them in, gives each worker at most `slots` batches at a time (its buffers),
and waits on the workers' pipes and process sentinels together: a worker
that dies is reported at once (WorkerDied), one whose stage raised sends the
traceback (PipelineError). Workers exit when the parent asks, when their
pipe closes, or within POLL_S of the parent's death (they watch getppid:
with fork, a later worker inherits the parent's end of an earlier worker's
pipe, so an end-of-file cannot be relied on).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections import deque
from multiprocessing import connection
from multiprocessing.reduction import recv_handle, send_handle

import numpy as np

from ._stages import SEEDED_MODULES, STAGE_NAMES, StageError
from .errors import PipelineError, WorkerDied

ALIGN = 64
POLL_S = 0.5


class _Leaf:
    """Where an array of a batch was taken out: its index among the staged
    arrays, and its torch dtype name when it was a torch tensor."""

    __slots__ = ("i", "torch")

    def __init__(self, i: int, torch_dtype: str | None):
        self.i, self.torch = i, torch_dtype

    def __reduce__(self):
        return (_Leaf, (self.i, self.torch))


def split(batch) -> tuple:
    """(skeleton, arrays): the batch with its numpy arrays and torch tensors
    replaced by _Leaf placeholders, and those arrays as numpy arrays."""
    arrays: list = []
    torch = sys.modules.get("torch")

    def walk(x):
        if isinstance(x, np.ndarray):
            arrays.append(x)
            return _Leaf(len(arrays) - 1, None)
        if torch is not None and isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            if t.is_neg():
                t = t.resolve_neg()
            name = str(t.dtype).rpartition(".")[2]
            arrays.append((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy())
            return _Leaf(len(arrays) - 1, name)
        if isinstance(x, tuple):
            items = [walk(v) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk(batch), arrays


def join(skeleton, leaves: list):
    """The batch of a skeleton with its placeholders replaced by `leaves`
    (numpy arrays; torch tensors again where they were tensors)."""

    def walk(x):
        if isinstance(x, _Leaf):
            arr = leaves[x.i]
            if x.torch is None:
                return arr
            import torch

            t = torch.from_numpy(arr)
            return t.view(torch.bfloat16) if x.torch == "bfloat16" else t
        if isinstance(x, tuple):
            items = [walk(v) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk(skeleton)


# ---- the worker process -----------------------------------------------------------------------------------


class _Staging:
    """A worker's staging buffers, one memfd mapping per slot."""

    def __init__(self, worker: int, slots: int):
        self.worker = worker
        self.maps: list = [None] * slots  # (mmap, size)
        self.gens = [0] * slots

    def put(self, slot: int, arrays: list):
        """Copies arrays into buffer `slot`, growing it (a new memfd) if they
        do not fit. Returns (generation, size, layout, new fd or None)."""
        layout, end = [], 0
        for a in arrays:
            end = -(-end // ALIGN) * ALIGN
            layout.append((end, a.dtype, a.shape))
            end += a.nbytes
        fd = None
        cur = self.maps[slot]
        if cur is None or cur[1] < end:
            size = max(1 << 16, -(-int(end * 1.25) // 4096) * 4096)
            fd = os.memfd_create(f"tsock-pipeline-w{self.worker}-s{slot}", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            self.maps[slot] = cur = (mmap.mmap(fd, size), size)
            self.gens[slot] += 1
        mm = cur[0]
        for (off, dtype, shape), a in zip(layout, arrays):
            np.copyto(np.ndarray(shape, dtype, buffer=mm, offset=off), a, casting="no")
        return self.gens[slot], cur[1], layout, fd


def worker_main(conn, stages, worker: int, parent: int, slots: int, preload: tuple) -> None:
    """A worker's loop: compute the batch of each task, stage it, report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    for module in preload:
        # Spawned, it starts without the parent's modules: import those whose
        # global generator is seeded per sample, as a forked worker has them.
        __import__(module)
    staging = _Staging(worker, slots)
    stages.take_ns()  # a forked worker starts with its parent's counts
    while True:
        try:
            if not conn.poll(POLL_S):
                if os.getppid() != parent:
                    return
                continue
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        tid, epoch, indices, slot = task
        try:
            batch = stages.batch(epoch, indices)
            skeleton, arrays = split(batch)
            gen, size, layout, fd = staging.put(slot, arrays)
            msg = ("ok", tid, slot, gen, size, fd is not None, skeleton, layout, stages.take_ns())
            conn.send(msg)
        except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
            _report(conn, tid, e)
            continue
        if fd is not None:
            send_handle(conn, fd, parent)
            os.close(fd)  # the mapping keeps the memory; the parent has its own descriptor


def _report(conn, tid: int, e: BaseException) -> None:
    stage = e if isinstance(e, StageError) else None
    cause = e.__cause__ if stage is not None and e.__cause__ is not None else e
    where = None if stage is None else (stage.stage, stage.index, stage.epoch)
    text = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    try:
        conn.send(("error", tid, where, f"{type(cause).__name__}: {cause}", text))
    except (OSError, ValueError):
        pass  # the parent is gone


# ---- the parent's side ---------------------------------------------------------------------------------


class _Result:
    __slots__ = ("worker", "slot", "key", "batch")

    def __init__(self, worker, slot, key, batch):
        self.worker, self.slot, self.key, self.batch = worker, slot, key, batch


class WorkerPool:
    """`workers` processes computing batches for one parent. One stream of
    tasks at a time (run()); the processes live until close()."""

    def __init__(self, stages, workers: int, start_method: str | None, slots: int, timeout: float | None, describe):
        self.stages = stages
        self.workers = workers
        self.start_method = start_method
        self.slots = slots
        self.timeout = timeout
        self.describe = describe  # describe(key) -> "batch 3 of epoch 0", for messages
        self.procs: list = []
        self.conns: list = []
        self.free: list = []  # per worker: its free slots
        self.maps: dict = {}  # (worker, slot) -> (generation, mmap)
        self.inflight: dict = {}  # task id -> (worker, slot, stream, key)
        self.ready: dict = {}  # task id -> _Result, received, not handed out yet
        self.held = None  # the _Result handed out last, until the next is asked for
        self.next_tid = 0
        self.stream = 0
        self.pid = None
        self.stage_ns = (0,) * len(STAGE_NAMES)  # the workers' time in each stage (Stages.take_ns)

    # ---- lifecycle ----

    def start(self) -> None:
        if self.procs:
            if os.getpid() != self.pid:
                raise PipelineError("a Pipeline's workers belong to the process that started them, not a forked child")
            return
        ctx = mp.get_context(self.start_method)
        parent = os.getpid()
        preload = tuple(m for m in SEEDED_MODULES if m in sys.modules)
        try:
            for w in range(self.workers):
                mine, theirs = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=worker_main,
                    args=(theirs, self.stages, w, parent, self.slots, preload),
                    name=f"tsock-pipeline-{w}",
                    daemon=True,
                )
                p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(mine)
                self.free.append(list(range(self.slots)))
        except BaseException:
            self.close()
            raise
        self.pid = parent

    def alive(self) -> bool:
        return bool(self.procs)

    def close(self) -> None:
        """Stops every worker (asks, waits up to 2 s, then kills) and joins it."""
        procs, conns = self.procs, self.conns
        self.procs, self.conns, self.free, self.inflight = [], [], [], {}
        self.ready, self.held = {}, None
        self.maps.clear()
        if self.pid is not None and os.getpid() != self.pid:
            return  # a forked child: the workers are not its own
        for c in conns:
            try:
                c.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()

    # ---- streams ----

    def run(self, tasks):
        """Yields (key, batch) for each (key, epoch, indices) of `tasks`, in
        order. A batch's arrays are views of a staging buffer, valid until
        the next item is asked for. A new run() supersedes an unfinished one
        (which then raises if resumed) and takes its buffers back."""
        self.start()
        self._reclaim()
        self.stream += 1
        stream = self.stream
        tasks = iter(tasks)
        order: deque = deque()
        more = True
        try:
            while True:
                if self.stream != stream:
                    raise PipelineError(
                        "another iteration of this pipeline started while this one was not finished: "
                        "a pipeline with workers runs one iteration at a time"
                    )
                while more and self._has_free():
                    try:
                        key, epoch, indices = next(tasks)
                    except StopIteration:
                        more = False
                        break
                    order.append(self._submit(key, epoch, indices, stream))
                if not order:
                    if not more:
                        return
                    self._receive(stream)  # every buffer is out with a superseded iteration's task
                    continue
                res = self.ready.pop(order[0], None)
                if res is None:
                    self._receive(stream)
                    continue
                order.popleft()
                self.held = res
                yield res.key, res.batch
                self.held = None
                self._release(res)
        finally:
            if self.stream == stream:
                self._reclaim()
                self.stream += 1  # results still on their way are dropped when they arrive

    def _reclaim(self) -> None:
        """Takes back the buffers of results no iteration will hand out."""
        for res in self.ready.values():
            self._release(res)
        self.ready.clear()
        if self.held is not None:
            self._release(self.held)
            self.held = None

    def _has_free(self) -> bool:
        return any(self.free)

    def _submit(self, key, epoch: int, indices, stream: int) -> int:
        w = max(range(len(self.free)), key=lambda i: len(self.free[i]))
        slot = self.free[w].pop()
        tid = self.next_tid
        self.next_tid += 1
        self.inflight[tid] = (w, slot, stream, key)
        try:
            self.conns[w].send((tid, epoch, indices, slot))
        except (OSError, ValueError):
            self._died(w)
        return tid

    def _release(self, res: _Result) -> None:
        if self.procs:
            self.free[res.worker].append(res.slot)

    def _receive(self, stream: int) -> None:
        """Waits for messages from the workers (or a death) and files them."""
        waitables = {}
        for w, (p, c) in enumerate(zip(self.procs, self.conns)):
            waitables[c] = w
            waitables[p.sentinel] = w
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = connection.wait(list(waitables), left)
            if got:
                break
            if deadline is not None and time.monotonic() >= deadline:
                busy = [self.describe(k) for (_, _, s, k) in self.inflight.values() if s == stream]
                self.close()
                raise PipelineError(
                    f"no batch from the pipeline's workers within timeout={self.timeout:g} s "
                    f"(waiting for {', '.join(busy) or 'nothing'}); workers stopped"
                )
        for obj in got:
            w = waitables[obj]
            if isinstance(obj, int):  # a sentinel: the process ended
                continue
            try:
                while obj.poll():
                    self._handle(w, obj, obj.recv(), stream)
            except (EOFError, OSError):
                self._died(w)
        for obj in got:
            if isinstance(obj, int) and not self.procs[waitables[obj]].is_alive():
                self._died(waitables[obj])

    def _handle(self, w: int, conn, msg, stream: int) -> None:
        kind, tid = msg[0], msg[1]
        worker, slot, task_stream, key = self.inflight.pop(tid)
        if kind == "ok":
            _, _, slot, gen, size, has_fd, skeleton, layout, ns = msg
            self.stage_ns = tuple(map(sum, zip(self.stage_ns, ns)))
            if has_fd:
                fd = recv_handle(conn)
                try:
                    self.maps[(w, slot)] = (gen, mmap.mmap(fd, size))
                finally:
                    os.close(fd)
            if task_stream != stream:
                self.free[w].append(slot)
                return
            mm = self.maps[(w, slot)][1]
            leaves = [np.ndarray(shape, dtype, buffer=mm, offset=off) for off, dtype, shape in layout]
            self.ready[tid] = _Result(w, slot, key, join(skeleton, leaves))
            return
        self.free[w].append(slot)
        if task_stream != stream:
            return
        _, _, where, summary, text = msg
        pid = self.procs[w].pid
        if where is None:
            what = f"{self.describe(key)} failed"
        else:
            what = f"{StageError.what(*where)} ({self.describe(key)})"
        raise PipelineError(f"{what} in pipeline worker {w} (pid {pid}): {summary}\n\nworker traceback:\n{text}")

    def _died(self, w: int) -> None:
        p = self.procs[w]
        p.join(1.0)
        code = p.exitcode
        how = "is unresponsive" if code is None else _exit_text(code)
        doing = [self.describe(k) for (wk, _, _, k) in self.inflight.values() if wk == w]
        self.close()
        raise WorkerDied(
            f"pipeline worker {w} (pid {p.pid}) {how}"
            + (f" while computing {', '.join(doing)}" if doing else "")
            + "; the other workers were stopped (the next iteration starts new ones)"
        )


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
