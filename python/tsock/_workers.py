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

import contextlib
import mmap
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
import weakref
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
    if stages.cache is not None:
        stages.cache.adopt_pipeline()  # its consumer entry is of the parent's pipeline
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
        tid, epoch, indices, slot, threads = task
        try:
            batch = stages.batch(epoch, indices, threads)
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


class _Worker:
    """One worker process as the parent sees it."""

    __slots__ = ("id", "proc", "conn", "free", "busy", "retiring")

    def __init__(self, wid: int, proc, conn, slots: int):
        self.id, self.proc, self.conn = wid, proc, conn
        self.free = list(range(slots))  # its slots not in use
        self.busy = 0  # its tasks in flight
        self.retiring = False  # given no more tasks; stopped once its tasks are in


# Every mapping of a worker's staging buffer this process holds, whatever
# pool it came from and whether or not a pool still lists it (a retired
# worker's batches still held, another pipeline's): what a fork of a new
# worker must leave out (review 36, L1).
_PARENT_MAPS: weakref.WeakSet = weakref.WeakSet()


def _parent_map(fd: int, size: int) -> mmap.mmap:
    """The parent's mapping of a worker's staging buffer."""
    mm = mmap.mmap(fd, size)
    _PARENT_MAPS.add(mm)
    return mm


@contextlib.contextmanager
def _kept_from_forks():
    """While a worker is forked: the parent's mappings of the workers'
    staging buffers out of the child (MADV_DONTFORK), back to normal
    after. A worker added at run time (workers="auto") would
    otherwise inherit the other workers' buffers and keep them, retired
    ones too, allocated as long as it lives (review 34, A1); for good, it
    would also take them from every later fork of the process, where a
    child touching a batch of stream() crashed (review 35, D1)."""
    dontfork, dofork = getattr(mmap, "MADV_DONTFORK", None), getattr(mmap, "MADV_DOFORK", None)
    marked = []
    try:
        if dontfork is not None and dofork is not None:
            for mm in list(_PARENT_MAPS):
                with contextlib.suppress(ValueError, OSError):  # closed meanwhile
                    mm.madvise(dontfork)
                    marked.append(mm)
        yield
    finally:
        for mm in marked:
            with contextlib.suppress(ValueError, OSError):
                mm.madvise(dofork)


class WorkerPool:
    """Worker processes computing batches for one parent. One stream of
    tasks at a time (run()); the processes live until close(). `workers`
    processes, or with `auto` (an _autosize.Controller) as many as it
    decides, resized between batches: a worker retired is given no new task
    and stopped once its tasks are in, so no batch is lost and the order is
    the tasks' whoever computes them."""

    def __init__(
        self,
        stages,
        workers: int,
        start_method: str | None,
        slots: int,
        timeout: float | None,
        describe,
        threads: int | None = None,
        auto=None,
    ):
        self.stages = stages
        self.workers = workers  # the count wanted
        self.threads = threads  # I/O threads per worker for `read` (None: none, the samples in turn)
        self.auto = auto
        self.start_method = start_method
        self.slots = slots
        self.timeout = timeout
        self.describe = describe  # describe(key) -> "batch 3 of epoch 0", for messages
        self.live: dict = {}  # worker id -> _Worker, retiring ones included
        self.retired: list = []  # processes asked to stop, not joined yet
        self.next_id = 0
        self.maps: dict = {}  # (worker, slot) -> (generation, mmap)
        self.inflight: dict = {}  # task id -> (worker, slot, stream, key)
        self.ready: dict = {}  # task id -> _Result, received, not handed out yet
        self.held = None  # the _Result handed out last, until the next is asked for
        self.next_tid = 0
        self.stream = 0
        self.pid = None
        self.stage_ns = (0,) * len(STAGE_NAMES)  # the workers' time in each stage (Stages.take_ns)
        self.received = 0  # batches received from the workers
        self.waited_ns = 0  # time run() waited for the workers with nothing to hand out
        self.delivered = 0  # batches run() handed out
        self.feedback = None  # () -> seconds downstream waited for its consumers so far (a Producer's ring)
        self._window = None  # what the running window started from
        self.changes: list = []  # (seconds since start, workers, threads, why) of each resize by `auto`
        self.started_ns = 0

    @property
    def procs(self) -> list:
        """The worker processes now computing (not those retiring). Read by
        other threads too (metrics): the dict is copied in one step, as
        resize() may change it meanwhile (review 35, D2)."""
        return [w.proc for w in list(self.live.values()) if not w.retiring]

    # ---- lifecycle ----

    def start(self) -> None:
        if self.live:
            if os.getpid() != self.pid:
                raise PipelineError("a Pipeline's workers belong to the process that started them, not a forked child")
            return
        self.pid = os.getpid()
        self.started_ns = time.perf_counter_ns()
        try:
            self._spawn(self.workers)
        except BaseException:
            self.close()
            raise

    def _spawn(self, count: int) -> None:
        ctx = mp.get_context(self.start_method)
        preload = tuple(m for m in SEEDED_MODULES if m in sys.modules)
        for _ in range(count):
            wid = self.next_id
            self.next_id += 1
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=worker_main,
                args=(theirs, self.stages, wid, self.pid, self.slots, preload),
                name=f"tsock-pipeline-{wid}",
                daemon=True,
            )
            try:
                # Only a fork copies the parent's mappings (spawn and
                # forkserver start afresh).
                forking = ctx.get_start_method() == "fork"
                with _kept_from_forks() if forking else contextlib.nullcontext():
                    p.start()
            finally:
                theirs.close()
            self.live[wid] = _Worker(wid, p, mine, self.slots)

    def alive(self) -> bool:
        return bool(self.live)

    def resize(self, workers: int) -> None:
        """Makes `workers` processes compute from the next task on: starts
        new ones, or retires the idlest (see _Worker.retiring). Retired ones
        are stopped as their tasks come in (_finish_retiring)."""
        self.workers = workers = max(1, int(workers))
        if not self.live:
            return  # start() makes them
        active = [w for w in self.live.values() if not w.retiring]
        # A worker still computing the tasks it had when it was retired (a
        # shrink taken back) takes tasks again rather than a new one
        # starting beside it: no more processes compute than asked, and no
        # fork (review 34, A4).
        for w in sorted((w for w in self.live.values() if w.retiring), key=lambda w: -w.busy):
            if len(active) >= workers:
                break
            w.retiring = False
            active.append(w)
        if len(active) < workers:
            self._spawn(workers - len(active))
        for w in sorted(active, key=lambda w: (w.busy, -w.id))[: max(0, len(active) - workers)]:
            w.retiring = True
        self._finish_retiring()

    def _finish_retiring(self) -> None:
        for w in [w for w in self.live.values() if w.retiring and w.busy == 0]:
            del self.live[w.id]
            for slot in range(self.slots):
                # Batches handed out keep their mapping alive as long as they are referenced.
                self.maps.pop((w.id, slot), None)
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
            w.conn.close()
            self.retired.append(w.proc)
        still = []
        for p in self.retired:
            p.join(0)
            if p.exitcode is None:
                still.append(p)
        self.retired = still

    def close(self) -> None:
        """Stops every worker (asks, waits up to 2 s, then kills) and joins it."""
        workers, retired = list(self.live.values()), self.retired
        self.live, self.retired, self.inflight = {}, [], {}
        self.ready, self.held = {}, None
        self.maps.clear()
        if self.pid is not None and os.getpid() != self.pid:
            return  # a forked child: the workers are not its own
        for w in workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        procs = [w.proc for w in workers] + retired
        deadline = time.monotonic() + 2.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for w in workers:
            w.conn.close()

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
        self._window = None
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
                    self._wait(stream)  # every buffer is out with a superseded iteration's task
                    continue
                res = self.ready.pop(order[0], None)
                if res is None:
                    self._wait(stream)
                    continue
                order.popleft()
                self.held = res
                self.delivered += 1
                if self.auto is not None:
                    self._autosize()
                yield res.key, res.batch
                self.held = None
                self._release(res)
        finally:
            if self.stream == stream:
                self._reclaim()
                self.stream += 1  # results still on their way are dropped when they arrive

    def _wait(self, stream: int) -> None:
        t0 = time.perf_counter_ns()
        try:
            self._receive(stream)
        finally:
            self.waited_ns += time.perf_counter_ns() - t0
            self._finish_retiring()

    def _autosize(self) -> None:
        """Closes the controller's window when it is over and applies its decision."""
        from ._autosize import MIN_BATCHES, WINDOW_S, Window

        now = time.perf_counter_ns()
        if self._window is not None:
            t0, d0, w0, s0, r0, b0 = self._window
            if (now - t0) / 1e9 < WINDOW_S or self.delivered - d0 < MIN_BATCHES:
                return
        back = self.feedback() if self.feedback is not None else None
        mark = (now, self.delivered, self.waited_ns, self.stage_ns, self.received, back)
        if self._window is None:
            self._window = mark
            return
        self._window = mark
        seconds = (now - t0) / 1e9
        window = Window(
            seconds=seconds,
            batches=self.delivered - d0,
            waited=(self.waited_ns - w0) / 1e9,
            stages={n: (a - b) / 1e9 for n, a, b in zip(STAGE_NAMES, self.stage_ns, s0)},
            received=self.received - r0,
            backpressure=None if back is None or b0 is None else (back - b0) / seconds,
        )
        decision = self.auto.step(window)
        if decision is not None:
            if self.threads is not None:
                self.threads = decision.threads
            self.resize(decision.workers)
            self.changes.append(((now - self.started_ns) / 1e9, self.workers, self.threads, decision.why))

    def _reclaim(self) -> None:
        """Takes back the buffers of results no iteration will hand out."""
        for res in self.ready.values():
            self._release(res)
        self.ready.clear()
        if self.held is not None:
            self._release(self.held)
            self.held = None

    def _has_free(self) -> bool:
        return any(w.free and not w.retiring for w in self.live.values())

    def _submit(self, key, epoch: int, indices, stream: int) -> int:
        w = max((w for w in self.live.values() if not w.retiring), key=lambda w: len(w.free))
        slot = w.free.pop()
        tid = self.next_tid
        self.next_tid += 1
        self.inflight[tid] = (w.id, slot, stream, key)
        w.busy += 1
        try:
            w.conn.send((tid, epoch, indices, slot, self.threads))
        except (OSError, ValueError):
            self._died(w.id)
        return tid

    def _release(self, res: _Result) -> None:
        w = self.live.get(res.worker)
        if w is not None and not w.retiring:
            w.free.append(res.slot)

    def _receive(self, stream: int) -> None:
        """Waits for messages from the workers (or a death) and files them."""
        waitables = {}
        for w in self.live.values():
            waitables[w.conn] = w.id
            waitables[w.proc.sentinel] = w.id
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
            wid = waitables[obj]
            if isinstance(obj, int):  # a sentinel: the process ended
                continue
            try:
                while obj.poll():
                    self._handle(wid, obj, obj.recv(), stream)
            except (EOFError, OSError):
                self._died(wid)
        for obj in got:
            if isinstance(obj, int) and not self.live[waitables[obj]].proc.is_alive():
                self._died(waitables[obj])

    def _handle(self, wid: int, conn, msg, stream: int) -> None:
        kind, tid = msg[0], msg[1]
        _, slot, task_stream, key = self.inflight.pop(tid)
        w = self.live[wid]
        w.busy -= 1
        if kind == "ok":
            _, _, slot, gen, size, has_fd, skeleton, layout, ns = msg
            self.stage_ns = tuple(map(sum, zip(self.stage_ns, ns)))
            self.received += 1
            if has_fd:
                fd = recv_handle(conn)
                try:
                    self.maps[(wid, slot)] = (gen, _parent_map(fd, size))
                finally:
                    os.close(fd)
            if task_stream != stream:
                w.free.append(slot)
                return
            mm = self.maps[(wid, slot)][1]
            leaves = [np.ndarray(shape, dtype, buffer=mm, offset=off) for off, dtype, shape in layout]
            self.ready[tid] = _Result(wid, slot, key, join(skeleton, leaves))
            return
        w.free.append(slot)
        if task_stream != stream:
            return
        _, _, where, summary, text = msg
        pid = w.proc.pid
        if where is None:
            what = f"{self.describe(key)} failed"
        else:
            what = f"{StageError.what(*where)} ({self.describe(key)})"
        raise PipelineError(f"{what} in pipeline worker {wid} (pid {pid}): {summary}\n\nworker traceback:\n{text}")

    def _died(self, wid: int) -> None:
        p = self.live[wid].proc
        p.join(1.0)
        code = p.exitcode
        how = "is unresponsive" if code is None else _exit_text(code)
        doing = [self.describe(k) for (wk, _, _, k) in self.inflight.values() if wk == wid]
        self.close()
        raise WorkerDied(
            f"pipeline worker {wid} (pid {p.pid}) {how}"
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
