"""Several processes: a killed producer is reported at once, a killed or
interrupted trainer leaves the others running, and a producer whose torch
DataLoader forks workers after loading libtsock.so (Go runtime inside)
works and dies cleanly."""

import os
import queue
import signal
import threading
import time

import numpy as np
import pytest
import tsock

# How long a child may take to start and get going (import numpy or torch,
# fork DataLoader workers): only a guard against a hang, generous because a
# loaded machine can take many times the usual few seconds. Bounds that a
# test is about are written where they are checked.
STARTUP_S = 120


def wait_line(proc, want, timeout=STARTUP_S):
    """Reads proc's stdout until a line starting with `want`; returns it.
    A reader thread feeds a queue, so a silent child fails the test at the
    deadline instead of blocking it forever."""
    lines = getattr(proc, "lines", None)
    if lines is None:
        lines = proc.lines = queue.Queue()

        def pump():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {want!r} within {timeout} s") from None
        if line is None:
            raise AssertionError(f"process exited ({proc.wait()}) before {want!r}: {proc.stderr.read()}")
        if line.startswith(want):
            return line.strip()


PRODUCER_FOREVER = """
import sys, time, numpy as np, tsock
p = tsock.Producer(None, sys.argv[1], slots=4)
i = 0
while True:
    p.publish((np.full(4, i, np.int64),))
    if i == 2:
        print("published", flush=True)
    i += 1
    time.sleep(0.01)
"""


def test_killed_producer_raises_producer_gone_quickly(channel, spawn):
    prod = spawn(PRODUCER_FOREVER, channel)
    wait_line(prod, "published")
    with tsock.Consumer(channel, start="now", timeout=10) as c:
        it = iter(c)
        first = int(next(it)[0][0])
        assert int(next(it)[0][0]) == first + 1
        os.kill(prod.pid, signal.SIGKILL)
        prod.wait()
        t0 = time.monotonic()
        # Seen within 50 ms of polling; 5 s leaves room for this thread's
        # own scheduling on a loaded machine and is still half the
        # consumer's 10 s timeout, the wait of a death never seen.
        with pytest.raises(tsock.ProducerGone, match="died"):
            for _ in it:  # what was published is still delivered, then the error
                assert time.monotonic() - t0 < 5
        assert time.monotonic() - t0 < 5.0


TRAINER = """
import sys, time, tsock
name, mode = sys.argv[1], sys.argv[2]
with tsock.Consumer(name, timeout=10) as c:
    n = 0
    try:
        for (y,) in c:
            n += 1
            if n == 3:
                print("ready", flush=True)
                if mode == "stall":
                    time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(3)
print("done", n, flush=True)
"""


def test_killed_trainer_leaves_the_others_running(channel, spawn, run_producer):
    # 40 batches a epoch through a ring of 4: the producer must get past the
    # dead trainer to finish.
    data = [(np.full(3, i, np.int64),) for i in range(40)]
    p = tsock.Producer(data, channel, slots=4, wait_readers=2)
    done = run_producer(p, epochs=2, close=False)
    victim = spawn(TRAINER, channel, "stall")
    with tsock.Consumer(channel, timeout=10) as survivor:
        it = iter(survivor)
        seen = [int(next(it)[0][0]) for _ in range(2)]
        wait_line(victim, "ready")  # mid-epoch, holding a batch
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(5) == -signal.SIGKILL
        seen += [int(y[0]) for (y,) in it]
        assert seen == list(range(40))  # epoch 0, whole
        assert [int(y[0]) for (y,) in survivor] == list(range(40))  # epoch 1
        done.join()
        assert p.stats()["readers_reclaimed"] == 1
    p.close()


def test_sigint_in_one_trainer_leaves_the_others_running(channel, spawn):
    with tsock.Producer(None, channel, slots=4) as p:
        p.publish((np.full(2, -1),))
        code = TRAINER.replace("tsock.Consumer(name, timeout=10)", "tsock.Consumer(name, start='now', timeout=120)")
        victim = spawn(code, channel, "block")
        survivor = tsock.Consumer(channel, start="now", timeout=10)
        while p.stats()["readers"] < 2:
            time.sleep(0.01)
        it = iter(survivor)
        for i in range(3):
            p.publish((np.full(2, i),))
            assert int(next(it)[0][0]) == i
        wait_line(victim, "ready")
        time.sleep(0.3)  # the victim now waits in the C reader for a 4th batch
        t0 = time.monotonic()
        victim.send_signal(signal.SIGINT)
        wait_line(victim, "interrupted", timeout=30)
        # Far sooner than the victim's own 120 s timeout would have ended
        # its wait (with room for a loaded machine's scheduling).
        assert time.monotonic() - t0 < 30.0
        assert victim.wait(5) == 3
        # It detached cleanly (not reclaimed as dead); the others go on.
        assert p.stats()["readers"] == 1
        assert p.stats()["readers_reclaimed"] == 0
        for i in range(3, 20):
            p.publish((np.full(2, i),))
            assert int(next(it)[0][0]) == i
        survivor.close()


FORK_PRODUCER = """
import multiprocessing, sys, torch, tsock
from torch.utils.data import DataLoader, Dataset

class Ids(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        # runs in a forked worker of a process that carries the Go runtime
        return torch.tensor(i), torch.full((3,), float(i))

name, epochs = sys.argv[1], sys.argv[2]
assert multiprocessing.get_start_method() == "fork"
loader = DataLoader(Ids(), batch_size=8, num_workers=2, persistent_workers=epochs == "forever")
p = tsock.Producer(loader, name, slots=4, wait_readers=1)
print("pid", p._pid, flush=True)
p.run(epochs=None if epochs == "forever" else int(epochs))
p.close()
print("closed", flush=True)
"""


def test_dataloader_workers_forked_from_a_go_process(channel, spawn):
    prod = spawn(FORK_PRODUCER, channel, 2)
    wait_line(prod, "pid")  # torch imported, the loader built: the channel comes with the first batch
    with tsock.Consumer(channel, output="torch", batch_size=5, timeout=STARTUP_S) as c:
        assert len(c) == 13
        for _ in range(2):
            ids = []
            for i, x in c:
                assert x[:, 0].tolist() == i.float().tolist()
                ids += i.tolist()
            assert ids == list(range(64))
        with pytest.raises(tsock.ChannelClosed):
            next(c)
    assert prod.wait(STARTUP_S) == 0, prod.stderr.read()


def test_killed_producer_with_live_workers_is_still_seen_dead(channel, spawn):
    # Workers forked after the channel exists inherit its descriptor; the
    # fork guard closes it in them, so they cannot keep the producer's lock
    # (and with it, its liveness) after the producer is killed.
    prod = spawn(FORK_PRODUCER, channel, "forever")
    wait_line(prod, "pid")  # torch imported, the loader built: the channel comes with the first batch
    with tsock.Consumer(channel, timeout=STARTUP_S) as c:
        for _ in range(20):  # into the second epoch: workers were forked after creation
            next(c, None)  # next(consumer) goes on across epochs
        os.kill(prod.pid, signal.SIGKILL)
        prod.wait()  # from its death: tearing down a torch process can take a while on a loaded machine
        t0 = time.monotonic()
        # Timing is tested above; here: seen dead at all (a death hidden by
        # the workers would wait the consumer's STARTUP_S and time out).
        with pytest.raises(tsock.ProducerGone):
            while True:
                next(c, None)
                assert time.monotonic() - t0 < 30


TRAINER_FORKS = """
import os, sys, tsock
maps = lambda: open("/proc/self/maps").read()
with tsock.Consumer(sys.argv[1], start="now", timeout=10) as c:
    it = iter(c)
    first = int(next(it)[0][0])
    # The trainer carries the C reader only, never the Go runtime.
    assert "libtsock_reader.so" in maps() and "libtsock.so" not in maps(), maps()
    pid = os.fork()
    if pid == 0:
        try:
            next(it)
            os._exit(1)
        except tsock.TsockError as e:
            os._exit(0 if e.status == -20 else 2)  # TSOCK_EFORKED: the handle is the parent's
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    print("ok", first, int(next(it)[0][0]), flush=True)
"""


def test_trainer_loads_no_go_runtime_and_survives_fork(channel, spawn):
    with tsock.Producer(None, channel, slots=4) as p:
        p.publish((np.full(2, -1),))
        trainer = spawn(TRAINER_FORKS, channel)
        while p.stats()["readers"] < 1:
            assert trainer.poll() is None, trainer.stderr.read()
            time.sleep(0.01)
        p.publish((np.full(2, 1),))
        p.publish((np.full(2, 2),))
        assert wait_line(trainer, "ok") == "ok 1 2"
        assert trainer.wait(10) == 0


def test_import_loads_neither_frameworks_nor_libraries(spawn):
    proc = spawn(
        """
        import sys, tsock
        maps = open("/proc/self/maps").read()
        print(sorted(m for m in ("torch", "jax") if m in sys.modules), "libtsock" in maps)
        """
    )
    out, err = proc.communicate(timeout=STARTUP_S)
    assert out.strip() == "[] False", err
