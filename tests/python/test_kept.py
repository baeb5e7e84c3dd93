"""Kept batches (issue 10, section 1): by default a batch stays what it was
for as long as the trainer refers to it, however long, in every output, with
the smallest ring (2 slots); lifetime="step" shows the old overwrite (so each
test here can fail). A trainer that keeps everything finishes, without the
channel growing; the plain loop copies nothing."""

import os
import sys
import threading

import numpy as np
import pytest
import tsock

OUTPUTS = ["numpy", "torch", "jax", "dlpack"]


def host(x, output):
    """A private numpy copy of a leaf of any output."""
    if output == "dlpack":
        return np.array(np.from_dlpack(x))
    if output == "torch":
        return x.numpy().copy()
    return np.array(x)


def batches(n, rows=4, cols=1024):
    """(x, y): x float32 [rows, cols] (4 pages of a slot) full of i, y int32 [rows] of i."""
    return [(np.full((rows, cols), i, np.float32), np.full(rows, i, np.int32)) for i in range(n)]


def start(channel, data, slots=2, **kw):
    prod = tsock.Producer(data, channel, slots=slots, wait_readers=1, **kw)
    t = threading.Thread(target=prod.run, daemon=True)
    t.start()
    return prod, t


def stop(prod, t):
    t.join(30)
    prod.close()


@pytest.mark.parametrize("lifetime", ["referenced", "step"])
@pytest.mark.parametrize("output", OUTPUTS)
def test_every_output_keeps_batches_in_a_list(channel, output, lifetime):
    data = batches(12)
    prod, t = start(channel, data)
    with tsock.Consumer(channel, output=output, lifetime=lifetime, timeout=10) as c:
        kept = list(c)
        same = []
        for (x, y), (want_x, want_y) in zip(kept, data):
            try:
                same.append(np.array_equal(host(x, output), want_x) and np.array_equal(host(y, output), want_y))
            except BufferError:  # "step", dlpack: a released batch refuses to export
                same.append(False)
    stop(prod, t)
    assert len(kept) == len(data)
    if lifetime == "referenced":
        assert all(same), same
    else:
        # The old contract: what was kept past the next batch was rewritten.
        assert not all(same), "lifetime='step' kept every batch: the test cannot tell"


@pytest.mark.parametrize("output", ["numpy", "torch", "jax"])
def test_batches_kept_for_a_few_steps_stay_whole(channel, output):
    # Gradient accumulation, pairs of batches, a metrics buffer: each batch
    # is read again two steps later, then dropped.
    data = batches(20)
    prod, t = start(channel, data)
    window, bad = [], []
    with tsock.Consumer(channel, output=output, timeout=10) as c:
        for i, (x, y) in enumerate(c):
            window.append((i, x, y))
            if len(window) == 3:
                j, old_x, old_y = window.pop(0)
                want_x, want_y = data[j]
                if not (np.array_equal(host(old_x, output), want_x) and np.array_equal(host(old_y, output), want_y)):
                    bad.append(j)
    stop(prod, t)
    assert bad == []


@pytest.mark.parametrize("output", ["numpy", "torch", "jax", "dlpack"])
def test_the_plain_loop_copies_nothing(channel, output):
    data = batches(16)
    prod, t = start(channel, data)
    with tsock.Consumer(channel, output=output, timeout=10) as c:
        start_, end = c._reader.base, c._reader.base + c._reader.length
        addrs = []
        for i, (x, y) in enumerate(c):
            assert np.array_equal(host(y, output), data[i][1])
            if output == "numpy":
                addrs.append(x.__array_interface__["data"][0])
            elif output == "torch":
                addrs.append(x.data_ptr())
            elif output == "jax":
                addrs.append(x.unsafe_buffer_pointer())
        assert i == 15
        assert c._life.kept == 0
    stop(prod, t)
    assert all(start_ <= a < end for a in addrs), "a batch was not read in place"


def test_kept_dlpack_objects_export_later(channel):
    # DLPackTensor objects not yet consumed count as referenced: they still
    # export the right bytes many batches later.
    data = batches(8)
    prod, t = start(channel, data)
    with tsock.Consumer(channel, output="dlpack", timeout=10) as c:
        kept = list(c)
        assert c._life.kept >= 6
        got = [np.from_dlpack(x).copy() for x, _ in kept]
        assert all(np.array_equal(g, d[0]) for g, d in zip(got, data))
    import torch  # after close too, in another framework

    assert torch.equal(torch.from_dlpack(kept[0][1]), torch.from_numpy(data[0][1]))
    stop(prod, t)


JAX_ASYNC = """
import sys, threading
import jax

# Newer JAX dispatches asynchronously on the CPU by default; 0.4.30 needs
# the flag, before its CPU backend starts.
jax.config.update("jax_cpu_enable_async_dispatch", True)
import jax.numpy as jnp
import numpy as np
import tsock

w = jnp.asarray(np.linspace(-1, 1, 256 * 256, dtype=np.float32).reshape(256, 256) / 16)

@jax.jit
def step(state, x):
    y = jax.lax.fori_loop(0, 60, lambda _, y: jnp.tanh(y @ w), x)
    return state + y.sum(), y[0, 0]

name, lifetime = sys.argv[1], sys.argv[2]
data = [(np.full((256, 256), i / 10, np.float32),) for i in range(10)]
prod = tsock.Producer(data, name, slots=2, wait_readers=1)
t = threading.Thread(target=prod.run, daemon=True)
t.start()
state = jnp.float32(0)
outs, pending = [], 0
with tsock.Consumer(name, output="jax", timeout=10, lifetime=lifetime) as c:
    for (x,) in c:
        state, first = step(state, x)
        outs.append(first)
        pending += not state.is_ready()
    state = jax.block_until_ready(state)
t.join(30)
prod.close()
want_state, want = jnp.float32(0), []
for (d,) in data:
    want_state, first = step(want_state, jnp.asarray(d.copy()))
    want.append(first)
print(pending, int([float(o) for o in outs] == [float(v) for v in want] and float(state) == float(want_state)))
"""


def test_jax_async_steps_read_their_own_batch(spawn, channel):
    # state = step(state, batch): JAX returns before the step has read the
    # batch, and the loop takes the next batch at once. Each step is slow
    # enough (about 0.1 s here) that it is still running when the next batch
    # is taken; the results must be those of the batches as published.
    got = {}
    for lifetime in ("referenced", "step"):
        p = spawn(JAX_ASYNC, f"{channel}-{lifetime[0]}", lifetime)
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        got[lifetime] = tuple(map(int, out.split()))
    pending, right = got["referenced"]
    assert pending > 0, "no step was still running when the next batch was taken: the test proves nothing"
    assert right == 1, "a step read a batch that had changed"
    assert got["step"][1] == 0, "lifetime='step' computed the right results: the test cannot tell"


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_rebatched_slices_are_kept_too(channel, output):
    # Consumer batches of 3 rows from producer batches of 4: slices in place,
    # and copies across producer batches; all kept, all whole.
    data = batches(6)
    prod, t = start(channel, data)
    with tsock.Consumer(channel, output=output, batch_size=3, timeout=10) as c:
        kept = list(c)
    stop(prod, t)
    xs = np.concatenate([host(x, output) for x, _ in kept])
    ys = np.concatenate([host(y, output) for _, y in kept])
    assert np.array_equal(xs, np.concatenate([x for x, _ in data]))
    assert np.array_equal(ys, np.concatenate([y for _, y in data]))


KEEP_ALL = """
import os, sys, threading
import numpy as np, tsock

name, output = sys.argv[1], sys.argv[2]
n = 1000
x = np.zeros((16, 1024), np.float32)  # 64 KiB, one per batch, never kept

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

def loader():
    for i in range(n):
        yield x, np.full(4, i, np.int32)  # int32: JAX (without x64) would copy int64

prod = tsock.Producer(None, name, slots=2, wait_readers=1)
def run():
    for b in loader():
        prod.publish(b)
    prod.end_epoch()
t = threading.Thread(target=run, daemon=True)
t.start()
path = f"/dev/shm/tsock.{name}"
labels = []
with tsock.Consumer(name, output=output, timeout=10) as c:
    it = iter(c)
    first = next(it)
    labels.append(first[1])
    del first
    st = os.stat(path)
    before = rss_kib()
    for _, y in it:
        labels.append(y)  # the evaluation loop: labels kept, images not
    grown = rss_kib() - before
    st2 = os.stat(path)
    kept = c._life.kept
t.join(30)
prod.close()
got = [int(np.asarray(y.numpy() if output == "torch" else y)[0]) for y in labels]
assert got == list(range(n)), [i for i, g in enumerate(got) if g != i][:10]
assert (st2.st_size, st2.st_blocks) == (st.st_size, st.st_blocks), "the channel's file grew"
print(kept, grown)
"""


@pytest.mark.parametrize("output", ["numpy", "torch", "jax"])
def test_keeping_every_batch_finishes_without_growing_the_channel(spawn, channel, output):
    # 1000 batches kept on a 2-slot ring: no deadlock, the /dev/shm file
    # keeps its size, and only the kept tensors' pages stay (one page per
    # label here; the 64 KiB images are given up).
    p = spawn(KEEP_ALL, channel, output)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err
    kept, grown_kib = map(int, out.split())
    assert kept >= 990
    assert grown_kib < 1000 * 64 / 4, f"RSS grew by {grown_kib} KiB: the unkept images were retained"


SURVIVE_CLOSE = """
import gc, sys, threading
import numpy as np, tsock

name, output, lifetime, how = sys.argv[1:5]
# A trainer has imported its framework before it makes a consumer. (Not
# only realism: torch 2.1 keeps the exception of its failed pynvml import,
# whose traceback keeps alive every frame that imported torch first, the
# consumer's own __init__ included, so a consumer that imports torch itself
# is never collected there.)
if output != "numpy":
    __import__(output)
data = [(np.full(1024, i, np.float32),) for i in range(10)]
prod = tsock.Producer(data, name, slots=2, wait_readers=1)
t = threading.Thread(target=prod.run)
t.start()
c = tsock.Consumer(name, output=output, timeout=10, lifetime=lifetime)
it = iter(c)
kept = [next(it)[0] for _ in range(3)]
if how == "close":
    c.close()
else:
    del c, it
    gc.collect()  # the consumer's finalizer detaches
# Without its reader the producer goes on: it rewrites both slots with the
# 7 batches left.
t.join()
prod.close()
print(" ".join(str(float(np.asarray(k.numpy() if output == "torch" else k)[0])) for k in kept))
"""


@pytest.mark.parametrize("how", ["close", "collected"])
@pytest.mark.parametrize("output", ["numpy", "torch", "jax"])
def test_kept_batches_survive_the_consumer(spawn, channel, output, how):
    # Batches kept past close() (or past the consumer's garbage collection)
    # read their own bytes while the producer rewrites the slots; they never
    # fault. In a child, so that a fault would fail the test, not pytest.
    values = {}
    for lifetime in ("referenced", "step"):
        p = spawn(SURVIVE_CLOSE, f"{channel}-{lifetime[0]}", output, lifetime, how)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        values[lifetime] = [float(v) for v in out.split()]
    assert values["referenced"] == [0.0, 1.0, 2.0]
    if output != "jax":  # JAX may copy on import: then nothing to rewrite
        assert values["step"] != [0.0, 1.0, 2.0]


def test_torch_guard_covers_moved_slots_and_forgets_them(channel):
    import torch
    from tsock import _torch

    before = list(zip(_torch._starts, _torch._ends))
    data = batches(8)
    prod, t = start(channel, data)
    with tsock.Consumer(channel, output="torch", timeout=10) as c:
        kept = list(c)
        moved = c._reader.slot_ranges()
        assert moved, "no slot moved: nothing was kept"
        last = kept[-1][0]
        assert _torch._in_mapping(last)  # in a moved slot: guarded
        with pytest.raises(tsock.ReadOnlyBatchError):
            last.add_(1)
        with pytest.raises(tsock.ReadOnlyBatchError):
            kept[0][0].add_(1)  # kept: still read-only
        assert torch.equal(kept[0][0], torch.from_numpy(data[0][0]))
    stop(prod, t)
    assert list(zip(_torch._starts, _torch._ends)) == before, "the consumer's ranges outlived it"


def test_lifetime_is_checked(channel):
    with pytest.raises(ValueError, match="lifetime"):
        tsock.Consumer(channel, lifetime="forever", timeout=0)


@pytest.mark.skipif(sys.platform != "linux", reason="Linux")
def test_no_file_descriptor_or_mapping_leaks(channel):
    # Keeping and dropping batches for a while leaves no mapping behind once
    # the batches are gone (each kept batch has one while it lives). Only
    # tsock's mappings are looked at: the process maps other things on its
    # own (a library loaded on first use, the Go runtime's thread stacks).
    def maps():
        with open("/proc/self/maps") as f:
            return [line.split()[0] for line in f]

    def segment_maps():
        with open("/proc/self/maps") as f:
            return [line for line in f if f"/tsock.{channel}" in line]

    data = batches(40)
    prod, t = start(channel, data)
    base = len(maps())
    with tsock.Consumer(channel, output="numpy", timeout=10) as c:
        kept = list(c)
        assert c._life.kept >= 30
        held = maps()
    stop(prod, t)
    assert len(held) > base + 30
    # The kept batches' own mappings: those that hold their arrays.
    spans = [tuple(int(x, 16) for x in r.split("-")) for r in held]
    where = {a.ctypes.data for batch in kept for a in batch}
    kept_maps = {r for r, (lo, hi) in zip(held, spans) if any(lo <= p < hi for p in where)}
    assert len(kept_maps) >= 30, kept_maps
    del kept
    import gc

    gc.collect()
    assert kept_maps.isdisjoint(maps()), sorted(kept_maps & set(maps()))
    del c  # a closed consumer still referenced keeps what its views may read
    gc.collect()
    assert segment_maps() == []
    assert len(os.listdir("/proc/self/fd")) < 200


def test_a_batch_kept_twice_is_freed_once(channel):
    # Keeping a held batch again (more of its leaves) makes a second kept
    # batch; each is freed exactly once (a stale second free could free a
    # later kept batch that got the same address).
    data = batches(6)
    prod, t = start(channel, data)
    frees = []
    with tsock.Consumer(channel, output="numpy", timeout=10) as c:
        reader = c._reader
        free = reader.lib.free
        reader.lib.free = lambda kept: frees.append(free(kept))
        it = iter(c)
        x, y = next(it)
        raw = reader.held[0]
        reader.keep(raw, 1)  # x
        reader.keep(raw, 2)  # and y
        assert frees == [0], "the first kept batch was not freed when kept again"
        del raw
        rest = [int(b[1][0]) for b in it]  # batch 0's slot is rewritten; nothing else kept
        assert np.array_equal(x, data[0][0]) and np.array_equal(y, data[0][1])
        assert rest == list(range(1, 6))
    stop(prod, t)
    del x, y
    import gc

    gc.collect()
    assert frees == [0, 0]


FORK_AFTER_KEEP = """
import os, sys, threading
import numpy as np, tsock

name, output = sys.argv[1:3]
if output != "numpy":
    __import__(output)
data = [(np.full(1024, i, np.float32),) for i in range(12)]
prod = tsock.Producer(data, name, slots=2, wait_readers=1)
t = threading.Thread(target=prod.run, daemon=True)
t.start()
host = lambda k: float(np.asarray(k.numpy() if output == "torch" else k)[0])
c = tsock.Consumer(name, output=output, timeout=10)
it = iter(c)
kept = [next(it)[0] for _ in range(4)]  # 0 and 1 kept (copied out), 2 and 3 held
pid = os.fork()  # a DataLoader worker started mid-epoch
if pid == 0:
    ok = [host(k) for k in kept] == [0.0, 1.0, 2.0, 3.0]
    try:
        c.close()  # the parent's reader: nothing to keep or detach here
    except BaseException as e:
        print("child: close raised", repr(e), file=sys.stderr, flush=True)
        os._exit(2)
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
kept += [b[0] for b in it]
c.close()
t.join(30)
prod.close()
print(os.waitstatus_to_exitcode(status), int([host(k) for k in kept] == [float(i) for i in range(12)]))
"""


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_fork_after_keep(spawn, channel, output):
    # A child forked while batches are kept and held reads them, and closes
    # its inherited consumer without error (the reader is the parent's);
    # the parent goes on keeping. (JAX is left out: it does not survive a
    # fork.)
    p = spawn(FORK_AFTER_KEEP, channel, output)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    child, parent = map(int, out.split())
    assert child == 0, err
    assert parent == 1


KILLED_PRODUCER = """
import sys, time
import numpy as np, tsock

prod = tsock.Producer(None, sys.argv[1], slots=2, wait_readers=1)
for i in range(4):
    prod.publish((np.full(1024, i, np.float32),))
print("published", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_kept_batches_outlive_a_killed_producer(spawn, channel, output):
    # The producer is killed while batches are kept (0, 1) and held (2, 3):
    # next() says ProducerGone, close() keeps the held ones, and every
    # batch reads its own bytes, before and after close; nothing faults.
    import signal

    def values(kept):
        return [float(np.asarray(k.numpy() if output == "torch" else k)[0]) for k in kept]

    p = spawn(KILLED_PRODUCER, channel)
    with tsock.Consumer(channel, output=output, timeout=120) as c:
        it = iter(c)
        kept = [next(it)[0] for _ in range(4)]
        assert p.stdout.readline() == "published\n"
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        with pytest.raises(tsock.ProducerGone):
            next(it)
        assert values(kept) == [0.0, 1.0, 2.0, 3.0]
    assert values(kept) == [0.0, 1.0, 2.0, 3.0]


KEEP_PAST_BUDGET = """
import os, sys, threading
os.environ["TSOCK_MAX_KEPT"] = "5"  # read at the first keep
import numpy as np, tsock

name = sys.argv[1]
data = [(np.full(1024, i, np.float32),) for i in range(40)]
prod = tsock.Producer(data, name, slots=2, wait_readers=1, timeout=5)
t = threading.Thread(target=prod.run, daemon=True)
t.start()
kept = []
c = tsock.Consumer(name, timeout=10)
try:
    for (x,) in c:
        kept.append(x)
    print("no error after", len(kept))
except tsock.TsockError as e:
    ok = all(float(k[0]) == i and float(k[-1]) == i for i, k in enumerate(kept))
    print(len(kept), ok, str(e).replace(chr(10), " "))
try:
    c.close()  # the held batches still referenced cannot be kept either: the same error
except tsock.TsockError:
    pass
"""


def test_keeping_past_the_budget_is_a_clear_error(spawn, channel):
    # Each kept batch takes memory map entries, which the rest of the
    # process needs too (malloc, thread stacks): past the budget (a quarter
    # of vm.max_map_count; TSOCK_MAX_KEPT=5 here) next() raises an error
    # that says why and what to do, the batches kept so far intact. Before
    # the budget, keeping went on until mmap failed for everyone.
    p = spawn(KEEP_PAST_BUDGET, channel)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    n, ok, message = out.split(" ", 2)
    assert n != "no" and 5 <= int(n) < 40, out
    assert ok == "True", out
    assert "vm.max_map_count" in message and "clone()" in message, out
