"""The GPU paths on a real GPU: skipped (with the reason) where PyTorch sees
none, as in CI. On a machine with one (the lent device machine: carry
build/, then `PYTHONPATH=python TSOCK_LIBRARY_DIR=build python3 -m pytest
tests/python/test_gpu.py`) these are the on-GPU checks that the fake driver
of test_device.py stands in for:

- the device path: a producer process with a device pool on cuda:0 and two
  trainer processes that get its batches as CUDA tensors at the pool's
  addresses (lifetime="step"), with the producer's values; with the default
  lifetime, private copies that a trainer keeps unchanged to the end;
- fences: a trainer queues a long kernel and then a read of each batch,
  and moves on at once; with 2 slots every read must still see its batch;
- the pinned path (device_path="never"): the channel's memory is pinned
  (cuMemHostRegister READ_ONLY on a /dev/shm mapping) and the copies land;
- a killed producer: the batches it published still arrive (from host
  memory), then ProducerGone;
- JAX on the device path, where JAX has a GPU backend, both lifetimes.
"""

import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"no CUDA GPU visible to PyTorch {torch.__version__} (the GPU checks run on a GPU machine)",
)

ROWS = 64 * 1024  # float32 per batch: 256 KiB

PRODUCER = """
import sys, numpy as np, tsock
ROWS = 64 * 1024
name, n, slots, readers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
batches = ((np.arange(ROWS, dtype=np.float32) + i, np.array([i])) for i in range(n))
with tsock.Producer(batches, name, slots=slots, wait_readers=readers, device="cuda:0", timeout=60) as p:
    p.run()
"""


def _producer(spawn, channel, n, slots=4, readers=1, code=PRODUCER):
    return spawn(code, channel, n, slots, readers)


def _trainer(spawn, code, *args):
    """A trainer process running code, with ROWS defined."""
    return spawn(f"ROWS = {ROWS}\n" + textwrap.dedent(code), *args)


def _finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out + err
    return out


def test_device_path_delivers_the_pool_zero_copy(channel, spawn):
    # lifetime="step": the zero-copy tensors (the default gives copies, below)
    trainer = """
        import sys, torch, tsock
        with tsock.Consumer(sys.argv[1], output="torch", device="cuda:0", lifetime="step", timeout=60) as c:
            assert c.placement == "device", c.placement_note
            base, length = c._reader.device_range()
            n = 0
            for x, i in c:
                assert x.is_cuda and i.is_cuda
                assert base <= x.data_ptr() < base + length  # the pool itself
                k = int(i.item())
                assert torch.equal(x, torch.arange(ROWS, dtype=torch.float32, device="cuda:0") + k), k
                n += 1
        print(n)
    """
    prod = _producer(spawn, channel, 50, readers=2)
    trainers = [_trainer(spawn, trainer, channel) for _ in range(2)]
    assert [_finish(t).strip() for t in trainers] == ["50", "50"]
    _finish(prod)


def test_kept_device_batches_never_change(channel, spawn):
    """The default lifetime on the device path: each batch is a private copy
    on the GPU, outside the pool, so a trainer that keeps every batch while
    the producer rewrites each slot many times over sees what was published."""
    trainer = """
        import sys, torch, tsock
        kept = []
        with tsock.Consumer(sys.argv[1], output="torch", device="cuda:0", timeout=60) as c:
            assert c.placement == "device", c.placement_note
            base, length = c._reader.device_range()
            for x, i in c:
                assert x.is_cuda and not base <= x.data_ptr() < base + length, "a kept batch in the pool"
                kept.append((x, i))
        torch.cuda.synchronize()
        want = torch.arange(ROWS, dtype=torch.float32, device="cuda:0")
        bad = [int(i) for x, i in kept if not torch.equal(x, want + int(i))]
        assert not bad and [int(i) for _, i in kept] == list(range(60)), bad
        print(len(kept))
    """
    prod = _producer(spawn, channel, 60, slots=2)
    assert _finish(_trainer(spawn, trainer, channel)).strip() == "60"
    _finish(prod)


def test_fences_keep_slots_until_queued_kernels_ran(channel, spawn):
    trainer = """
        import sys, torch, tsock
        sums = []
        with tsock.Consumer(sys.argv[1], output="torch", device="cuda:0", timeout=60) as c:
            for x, i in c:
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the read
                sums.append((x.sum(), i.clone()))  # queued; next() comes at once
        torch.cuda.synchronize()
        base = torch.arange(ROWS, dtype=torch.float32, device="cuda:0")
        bad = [int(i) for s, i in sums if not torch.equal(s, (base + int(i)).sum())]
        assert not bad, f"reads that saw another batch: {bad}"
        print(len(sums))
    """
    prod = _producer(spawn, channel, 40, slots=2)
    assert _finish(_trainer(spawn, trainer, channel)).strip() == "40"
    _finish(prod)


def test_pinned_path_registers_the_mapping(channel, spawn):
    trainer = """
        import sys, torch, tsock
        with tsock.Consumer(sys.argv[1], output="torch", device="cuda:0", device_path="never", timeout=60) as c:
            assert c.placement == "pinned", c.placement_note
            host = torch.frombuffer(c._reader.payload, dtype=torch.uint8)
            assert host.is_pinned()  # cuMemHostRegister(READ_ONLY) of the /dev/shm mapping
            n = 0
            for x, i in c:
                assert x.is_cuda and torch.equal(x, torch.arange(ROWS, dtype=torch.float32, device="cuda:0") + int(i))
                n += 1
        print(n)
    """
    prod = _producer(spawn, channel, 20)
    assert _finish(_trainer(spawn, trainer, channel)).strip() == "20"
    _finish(prod)


def test_killed_producer_batches_still_arrive(channel, spawn):
    trainer = """
        import os, signal, sys, time, torch, tsock
        got = []
        with tsock.Consumer(sys.argv[1], output="torch", device="cuda:0", timeout=60) as c:
            try:
                for x, i in c:
                    k = int(i.item())
                    assert float(x[1]) == 1.0 + k, k
                    got.append(k)
                    if k == 3:
                        time.sleep(0.5)  # the ring fills behind us
                        os.kill(int(sys.argv[2]), signal.SIGKILL)
                        time.sleep(0.3)
            except tsock.ProducerGone:
                pass
        assert got == list(range(len(got))) and len(got) > 4, got
        print(len(got))
    """
    prod = _producer(spawn, channel, 10_000, slots=2)
    t = _trainer(spawn, trainer, channel, prod.pid)
    assert int(_finish(t).strip()) > 4
    prod.wait(30)


@pytest.fixture
def jax_gpu():
    """Skips (saying why) where JAX is missing or has no GPU backend."""
    jax = pytest.importorskip("jax")
    try:
        jax.devices("gpu")
    except RuntimeError as e:
        pytest.skip(f"JAX {jax.__version__} has no GPU backend here: {e}")


@pytest.mark.parametrize("lifetime", ["referenced", "step"])
def test_jax_device_path(channel, spawn, lifetime, jax_gpu):
    """Both leaves of each batch through jax.dlpack.from_dlpack; with the
    default lifetime every array kept to the end still holds its batch."""
    trainer = """
        import sys, numpy as np, tsock
        lifetime = sys.argv[2]
        kept = []
        with tsock.Consumer(sys.argv[1], output="jax", device="cuda:0", lifetime=lifetime, timeout=60) as c:
            assert c.placement == "device", c.placement_note
            for x, i in c:
                assert "cuda" in str(x.devices()).lower() or "gpu" in str(x.devices()).lower(), x.devices()
                np.testing.assert_array_equal(np.asarray(x), np.arange(ROWS, dtype=np.float32) + int(i[0]))
                kept.append((x, i) if lifetime == "referenced" else (None, int(i[0])))
        for x, i in kept:
            if x is not None:
                np.testing.assert_array_equal(np.asarray(x), np.arange(ROWS, dtype=np.float32) + int(i[0]))
        print(len(kept))
    """
    prod = _producer(spawn, channel, 20, slots=2)
    assert _finish(_trainer(spawn, trainer, channel, lifetime)).strip() == "20"
    _finish(prod)


@pytest.mark.parametrize("lifetime", ["referenced", "step"])
def test_jax_fences_cover_its_own_streams(channel, spawn, lifetime, jax_gpu):
    """JAX reads a batch on its compute stream, behind work queued before it,
    and the loop itself never waits for the GPU; with 2 slots the producer
    would rewrite a slot under a read that a fence on another stream let go
    (what keeps it: each release waits until the device is idle). One leaf
    per batch: one import, so one stream named (two would be fenced with the
    whole device in C anyway). With the fix reverted, "step" failed on an
    H200; "referenced" (a private copy, queued at once) did not."""
    trainer = """
        import sys, jax, jax.numpy as jnp, numpy as np, tsock
        big = jnp.ones((4096, 4096), jnp.float32)
        heavy = jax.jit(lambda a: (a @ a @ a @ a @ a @ a).sum())  # some ms of GPU time
        reads = []
        with tsock.Consumer(sys.argv[1], output="jax", device="cuda:0", lifetime=sys.argv[2], timeout=60) as c:
            for (x,) in c:
                heavy(big)  # queued; nothing here waits for the GPU
                reads.append(jnp.stack([x[0], x[-1]]))
        got = [np.asarray(r).tolist() for r in jax.block_until_ready(reads)]
        assert [g[0] for g in got] == list(range(40)), [g[0] for g in got]
        assert all(g[1] == ROWS - 1 + g[0] for g in got), got
        print(len(got))
    """
    pair = "(np.arange(ROWS, dtype=np.float32) + i, np.array([i]))"
    one_leaf = PRODUCER.replace(pair, "(np.arange(ROWS, dtype=np.float32) + i,)")
    assert one_leaf != PRODUCER
    prod = _producer(spawn, channel, 40, slots=2, code=one_leaf)
    assert _finish(_trainer(spawn, trainer, channel, lifetime)).strip() == "40"
    _finish(prod)
