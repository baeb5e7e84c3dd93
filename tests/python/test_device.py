"""The device path from Python without a GPU: Producer(device="cuda:0") and
Consumer(device=...) in two processes against the fake CUDA driver
(tests/c/fake_cuda.c, through TSOCK_LIBCUDA), with a CPU stand-in for
torch's CUDA side. Checked: zero-copy kDLCUDA tensors at the pool's
addresses with the producer's values, the consumer's stream waiting for the
producer's copies, fences that keep a slot from the producer while a slow
"kernel" queued before the release still reads it, and placement: another
GPU or a MIG instance falls back to the host path, or raises NoDevicePath
with device_path="require"."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fakecuda
import pytest
import tsock
from conftest import child_env

FAKE = fakecuda.path()
needs_fake = pytest.mark.skipif(not FAKE.is_file(), reason="fake CUDA driver not built (make build)")

PRODUCER = """
import sys
import numpy as np
import tsock

name, n, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
WAIT = 100  # for the consumer to start: on a loaded 2-CPU machine, importing torch takes long
batches = [(np.arange(4096, dtype=np.int32) + 7 * i, np.full((4,), i % 2 == 0)) for i in range(n)]
with tsock.Producer(batches, name, slots=slots, wait_readers=1, device="cuda:0", timeout=WAIT) as p:
    p.run()
print("published", n)
"""

# The consumer's side: torch's CUDA calls replaced by a CPU stand-in that
# reads fake device memory (host memory in the fake driver) through numpy.
CONSUMER_PRELUDE = """
import ctypes, os, sys
WAIT = 100  # for the producer to start (see PRODUCER)
import numpy as np
import torch
import tsock
from tsock import _backends, _devices

fake = ctypes.CDLL(os.environ["TSOCK_LIBCUDA"])
fake.cuInit(0)
ctx = ctypes.c_void_p()
assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert fake.cuCtxSetCurrent(ctx) == 0  # a framework has a context current
stream = ctypes.c_void_p()
assert fake.cuStreamCreate(ctypes.byref(stream), 1) == 0
fake.fake_cuda_launch_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                       ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong)]

import fakecuda
stats = fakecuda.reader(fake)

api = ctypes.pythonapi
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

class Device:
    '''What the consumer asks of torch.cuda, answered on the CPU.'''
    def __init__(self):
        self.seen = []  # (device_type, device_id, address) per tensor
        self.guarded = None
    def current_stream(self):
        return stream.value
    def from_capsule(self, cap):
        p = api.PyCapsule_GetPointer(cap, b"dltensor")
        data = ctypes.c_void_p.from_address(p).value
        dev_type, dev_id = ctypes.c_int32.from_address(p + 8).value, ctypes.c_int32.from_address(p + 12).value
        ndim = ctypes.c_int32.from_address(p + 16).value
        bits = ctypes.c_uint8.from_address(p + 21).value
        shape_p = ctypes.c_void_p.from_address(p + 24).value
        shape = [ctypes.c_int64.from_address(shape_p + 8 * k).value for k in range(ndim)]
        n = int(np.prod(shape)) if shape else 1
        self.seen.append((dev_type, dev_id, data))
        buf = (ctypes.c_char * (n * bits // 8)).from_address(data)
        return np.frombuffer(buf, {8: np.uint8, 32: np.int32}[bits]).reshape(shape)
    def finish(self, t, code, copy):
        return t.copy() if copy else t
    takes_objects = False
    use_flags = 0
    bool_as_uint8 = True
    def owned(self, host_output, arr, code):
        return arr
    def protect(self, base, length):
        self.guarded = (base, length)
        return lambda: None
    # the pinned host path, for the fallback
    def register(self, reader):
        return None
    def on_stream(self):
        import contextlib
        return contextlib.nullcontext()
    def copy(self, host):
        return host.clone()
    def record(self):
        return object()
    def wait(self, event):
        pass
    def hand_out(self, event, tensors):
        pass

dev = Device()
orig_check, orig_backend = _devices.check_device, _backends.backend
_devices.check_device = lambda device, output: torch.device("cuda", 0)
_backends.backend = lambda device: dev
name = sys.argv[1]
"""


def _run(tmp_path, consumer_code, n, slots, consumer_env=None, killed=False, consumer_args=()):
    env = child_env()
    env["TSOCK_LIBCUDA"] = str(FAKE)
    # The pid too: tmp_path's name is the test's, the same in every pytest
    # run, and two runs at once (another job beside this one) took
    # each other's channel ("has a live producer") and removed it below.
    name = f"pt-dev-{os.getpid()}-{tmp_path.name}"[:60]
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, name, str(n), str(slots)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    cenv = dict(env, **(consumer_env or {}))
    err = None
    try:
        consumer = subprocess.run(
            [sys.executable, "-c", CONSUMER_PRELUDE + textwrap.dedent(consumer_code), name, str(producer.pid)]
            + list(consumer_args),
            env=cenv,
            capture_output=True,
            text=True,
            timeout=200,
        )
        err = producer.communicate(timeout=60)[1]
    finally:
        producer.kill()
        Path(f"/dev/shm/tsock.{name}").unlink(missing_ok=True)
    if err is None:
        err = producer.communicate()[1]  # killed above: what it said
    assert consumer.returncode == 0, consumer.stderr + consumer.stdout + "\nproducer: " + (err or "")
    assert producer.returncode == (-9 if killed else 0), err
    return consumer.stdout


@needs_fake
def test_device_batches_are_zero_copy_and_ordered(tmp_path):
    out = _run(
        tmp_path,
        """
        before = stats()
        with tsock.Consumer(name, output="torch", device="cuda:0", timeout=WAIT) as c:
            assert c.placement == "device" and c.placement_note is None, (c.placement, c.placement_note)
            base, length = dev.guarded  # the pool's range is guarded against writes
            for i, (x, flag) in enumerate(c):
                assert (x == np.arange(4096, dtype=np.int32) + 7 * i).all()
                assert flag.tolist() == [1, 1, 1, 1] if i % 2 == 0 else [0, 0, 0, 0]
            assert i == 9
            types = {(t, d) for t, d, _ in dev.seen}
            assert types == {(2, 0)}, types  # kDLCUDA, device 0
            assert all(base <= a < base + length for _, _, a in dev.seen)
            r = c._reader
            assert not any(r.base <= a < r.base + r.length for _, _, a in dev.seen)  # not host memory
        after = stats()
        assert after.ipc_opens - before.ipc_opens == 1, "the pool is opened once"
        assert after.stream_waits - before.stream_waits == 10, "a wait per batch, on our stream"
        assert after.events_recorded - before.events_recorded == 10, "a fence per batch at release"
        print("ok")
        """,
        n=10,
        slots=4,
    )
    assert out.strip() == "ok"


@needs_fake
def test_queued_reads_keep_their_batch(tmp_path):
    # The trainer queues a 20 ms read of each batch and moves on at once;
    # with 2 slots the producer would overwrite a slot under a pending read
    # if the release did not wait for the read (its fence).
    out = _run(
        tmp_path,
        """
        sums, want = [], []
        # Zero-copy device tensors (the default lifetime copies them).
        with tsock.Consumer(name, output="torch", device="cuda:0", timeout=WAIT, lifetime="step") as c:
            for x, _ in c:
                s = ctypes.c_ulonglong(0)
                sums.append(s)
                want.append(x.tobytes())
                fake.fake_cuda_launch_read(stream, x.ctypes.data, x.nbytes, 20_000_000, ctypes.byref(s))
        def fnv(b):
            h = 1469598103934665603
            for ch in b:
                h = ((h ^ ch) * 1099511628211) & (2**64 - 1)
            return h
        bad = [i for i, (s, w) in enumerate(zip(sums, want)) if s.value != fnv(w)]
        assert not bad, f"reads that saw another batch: {bad}"
        print("ok", len(sums))
        """,
        n=8,
        slots=2,
    )
    assert out.split() == ["ok", "8"]


@needs_fake
def test_killed_producer_batches_come_from_host_memory(tmp_path):
    # Once the producer is gone its device pool is not to be used; the
    # batches it published still reach the trainer (copied up from host
    # memory), then ProducerGone.
    out = _run(
        tmp_path,
        """
        import signal
        got = []
        with tsock.Consumer(name, output="torch", device="cuda:0", timeout=WAIT) as c:
            assert c.placement == "device"
            try:
                for i, (x, flag) in enumerate(c):
                    assert (np.asarray(x) == np.arange(4096, dtype=np.int32) + 7 * i).all(), i
                    got.append(i)
                    if i == 3:
                        # Once the ring is full (batch 4 published behind
                        # the one we hold; header.published is at byte 256).
                        deadline = time.monotonic() + 20
                        while time.monotonic() < deadline:
                            with open(f"/dev/shm/tsock.{name}", "rb") as f:
                                if int.from_bytes(f.read(264)[256:264], "little") >= 5:
                                    break
                            time.sleep(0.01)
                        os.kill(int(sys.argv[2]), signal.SIGKILL)
                        time.sleep(0.3)
                raise AssertionError("the epoch ended")
            except tsock.ProducerGone:
                pass
        assert got[:4] == [0, 1, 2, 3] and got == list(range(len(got))) and len(got) > 4, got
        print("ok", len(got))
        """.replace("import signal", "import signal, time"),
        n=1000,
        slots=2,
        killed=True,
    )
    assert out.split()[0] == "ok"


@needs_fake
def test_other_gpu_or_mig_falls_back_or_refuses(tmp_path):
    out = _run(
        tmp_path,
        """
        # The fallback consumer first: it keeps the producer (and channel) waiting.
        with tsock.Consumer(name, output="torch", device="cuda:0", timeout=WAIT) as c:
            try:
                tsock.Consumer(name, output="torch", device="cuda:0", device_path="require", timeout=WAIT)
            except tsock.NoDevicePath as e:
                assert "MIG" in str(e) and e.status == -23, e
            else:
                raise AssertionError("device_path='require' opened a pool on another GPU")
            assert c.placement == "pinned", c.placement
            assert "not among this process's" in c.placement_note
            got = [int(x[0]) for x, _ in c]
        assert got == [7 * i for i in range(3)], got
        print("ok")
        """,
        n=3,
        slots=2,
        consumer_env={"FAKE_CUDA_UUIDS": "5,6"},
    )
    assert out.strip() == "ok"


def test_device_path_arguments():
    with pytest.raises(ValueError, match="device_path"):
        tsock.Consumer("no-such-channel", output="torch", device="cuda:0", device_path="always", timeout=0)
    with pytest.raises(ValueError, match="CUDA device"):
        tsock.Producer([], "x", device="cpu")
    assert tsock.Producer([], "x", device="cuda:3").cuda_device == 3
    assert tsock.Producer([], "x").cuda_device == -1


@needs_fake
@pytest.mark.parametrize("jax_stream", [None, "ours"])
def test_jax_objects_wait_on_the_host_whatever_stream_it_names(tmp_path, jax_stream):
    # JAX gets DLPackTensor objects (it takes no bare capsules since 0.7.2)
    # and names a stream in __dlpack__(stream=...) for the import's
    # readiness, but reads the array on compute streams of its own, which
    # an event recorded at release would not cover (and on the H200 it named
    # another stream for each leaf of a batch). So whatever it names, the
    # host waits for the copy and each release waits for the device
    # (cuCtxSynchronize).
    out = _run(
        tmp_path,
        """
        dev.takes_objects = True
        STREAM = %s
        def from_object(obj):
            assert obj.__dlpack_device__() == (2, 0)
            return dev.from_capsule(obj.__dlpack__(stream=STREAM))
        dev.from_object = from_object
        before = stats()
        with tsock.Consumer(name, output="jax", device="cuda:0", timeout=WAIT) as c:
            assert c.placement == "device", c.placement_note
            n = 0
            for i, (x, flag) in enumerate(c):
                assert (x == np.arange(4096, dtype=np.int32) + 7 * i).all()
                n += 1
        after = stats()
        waits, syncs = after.stream_waits - before.stream_waits, after.ctx_syncs - before.ctx_syncs
        assert (waits, syncs) == (0, n), (waits, syncs, n)
        print("ok", n)
        """
        % ("None" if jax_stream is None else "stream.value"),
        n=5,
        slots=2,
    )
    assert out.split() == ["ok", "5"]


def test_jax_device_without_gpu_says_why():
    import jax

    try:
        jax.devices("gpu")
        pytest.skip("JAX has a GPU backend here")
    except RuntimeError:
        pass
    with pytest.raises(tsock.CUDAUnavailable, match="no GPU backend"):
        tsock.Consumer("no-such-channel", output="jax", device="cuda:0", timeout=0)
    with pytest.raises(ValueError, match="CUDA device"):
        tsock.Consumer("no-such-channel", output="jax", device="tpu", timeout=0)


@needs_fake
def test_dlpack_output_exports_the_device_copy(tmp_path):
    # output="dlpack" needs no framework: DLPackTensor objects of the device
    # copy, ordered on the stream the consumer's from_dlpack passes.
    out = _run(
        tmp_path,
        """
        _devices.check_device, _backends.backend = orig_check, orig_backend  # no framework stand-in
        before = stats()
        with tsock.Consumer(name, output="dlpack", device="cuda:0", timeout=WAIT) as c:
            assert c.placement == "device"
            n = 0
            for i, (x, flag) in enumerate(c):
                assert x.__dlpack_device__() == (2, 0)
                cap = x.__dlpack__(stream=stream.value)
                assert (dev.from_capsule(cap) == np.arange(4096, dtype=np.int32) + 7 * i).all()
                n += 1
        after = stats()
        assert after.stream_waits - before.stream_waits == n  # on the stream it was given
        print("ok", n)
        """,
        n=4,
        slots=2,
    )
    assert out.split() == ["ok", "4"]


@needs_fake
def test_dlpack_output_without_device_path_refuses(tmp_path):
    # Another GPU (or a MIG instance): nothing could copy for a framework-less
    # consumer, so it refuses; a host consumer then drains the channel.
    out = _run(
        tmp_path,
        """
        _devices.check_device, _backends.backend = orig_check, orig_backend
        with tsock.Consumer(name, timeout=WAIT) as host:  # first: it keeps the producer (and channel) waiting
            try:
                tsock.Consumer(name, output="dlpack", device="cuda:0", timeout=WAIT)
            except tsock.NoDevicePath as e:
                assert "MIG" in str(e) and e.status == -23, e
            else:
                raise AssertionError("opened a pool on another GPU")
            assert host.placement == "host" and len(list(host)) == 3
        print("ok")
        """,
        n=3,
        slots=2,
        consumer_env={"FAKE_CUDA_UUIDS": "5,6"},
    )
    assert out.strip() == "ok"


@needs_fake
def test_dlpack_capsule_keeps_the_pool_after_close(tmp_path):
    # A kDLCUDA capsule keeps the device pool mapped after its consumer is
    # closed: the producer's close must wait for it rather than free the
    # pool under the mapping, and free the pool once the capsule is gone.
    out = _run(
        tmp_path,
        """
        import glob, time
        _devices.check_device, _backends.backend = orig_check, orig_backend
        kept = None
        # The capsule outlives the batch: the old lifetime (the default would
        # hold the batch while the capsule lives).
        with tsock.Consumer(name, output="dlpack", device="cuda:0", timeout=WAIT, lifetime="step") as c:
            for x, _ in c:
                if kept is None:
                    kept = x.__dlpack__(stream=stream.value)
        pid = int(sys.argv[2])
        def pool_allocated():
            return bool(glob.glob(f"/dev/shm/tsockfake.mem.{pid}.*"))
        def producer_running():
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        time.sleep(0.3)
        assert producer_running() and pool_allocated(), "the producer freed the pool under a capsule"
        del kept  # the last mapping of the pool goes
        deadline = time.monotonic() + 30  # a process's exit: only a failure waits this long
        while producer_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not producer_running(), "the producer still waits"
        assert not pool_allocated(), "the pool was left to the producer's exit"
        print("ok")
        """,
        n=3,
        slots=2,
    )
    assert out.strip() == "ok"


@needs_fake
def test_per_thread_stream_of_another_thread_is_fenced(tmp_path):
    # __dlpack__(stream=2) is CU_STREAM_PER_THREAD: the stream of the thread
    # that asks. A worker thread queues a 20 ms read on its own per-thread
    # stream; the main thread's next batch releases this one: the slot (2 in
    # the ring) must not go back before the worker's read ran.
    out = _run(
        tmp_path,
        """
        import threading, time
        _devices.check_device, _backends.backend = orig_check, orig_backend
        sums = []
        def fnv(b):
            h = 1469598103934665603
            for ch in b:
                h = ((h ^ ch) * 1099511628211) & (2**64 - 1)
            return h
        def work(x):
            cap = x.__dlpack__(stream=2)
            data = ctypes.c_void_p.from_address(api.PyCapsule_GetPointer(cap, b"dltensor")).value
            s = ctypes.c_ulonglong(0)
            sums.append(s)
            fake.fake_cuda_launch_read(2, data, 4096 * 4, 20_000_000, ctypes.byref(s))
        with tsock.Consumer(name, output="dlpack", device="cuda:0", timeout=WAIT) as c:
            for x, _ in c:
                t = threading.Thread(target=work, args=(x,))
                t.start()
                t.join()
        time.sleep(0.05)
        fake.fake_cuda_run_due()
        want = [fnv((np.arange(4096, dtype=np.int32) + 7 * i).tobytes()) for i in range(len(sums))]
        bad = [i for i, (s, w) in enumerate(zip(sums, want)) if s.value != w]
        assert not bad, f"reads that saw another batch: {bad}"
        print("ok", len(sums))
        """,
        n=8,
        slots=2,
    )
    assert out.split() == ["ok", "8"]


@needs_fake
@pytest.mark.parametrize("lifetime", ["referenced", "step"])
def test_kept_device_batches_stay_whole(tmp_path, lifetime):
    # The default lifetime on the device path: torch batches are copies made
    # on the device from the pool (device memory cannot be swapped like host
    # memory), so batches kept in a list stay right with 2 slots. With
    # lifetime="step" they are the pool itself, which the producer rewrites.
    out = _run(
        tmp_path,
        """
        with tsock.Consumer(name, output="torch", device="cuda:0", timeout=WAIT, lifetime=sys.argv[3]) as c:
            assert c.placement == "device"
            kept = [x for x, _ in c]
            base, length = dev.guarded
            in_pool = [base <= x.ctypes.data < base + length for x in kept]
            right = [bool((np.asarray(x) == np.arange(4096, dtype=np.int32) + 7 * i).all()) for i, x in enumerate(kept)]
        print(len(kept), sum(in_pool), sum(right))
        """,
        n=8,
        slots=2,
        consumer_args=[lifetime],
    )
    n, in_pool, right = map(int, out.split())
    assert n == 8
    if lifetime == "referenced":
        assert (in_pool, right) == (0, 8)
    else:
        assert in_pool == 8 and right < 8


@needs_fake
def test_kept_dlpack_device_batches_are_refused_beyond_the_ring(tmp_path):
    # output="dlpack" with a device hands out the pool itself: a batch is
    # held while referenced, but cannot be kept (copied) past the ring:
    # keeping them all raises, clearly, instead of stalling the producer or
    # letting it rewrite them. The plain loop works.
    out = _run(
        tmp_path,
        """
        _devices.check_device, _backends.backend = orig_check, orig_backend
        # resume: the second loop goes on with the epoch the first broke off
        with tsock.Consumer(name, output="dlpack", device="cuda:0", timeout=WAIT, carry_over=True) as c:
            kept = []
            try:
                for b in c:
                    kept.append(b)
            except tsock.TsockError as e:
                assert e.status == -17 and "cannot be kept" in str(e), e
                print("refused", len(kept))
            del kept, b  # nothing refers to a batch any more
            seen = sum(1 for _ in c)  # the rest of the epoch, nothing kept
        print("ok", seen)
        """,
        n=8,
        slots=2,
    )
    assert out.split() == ["refused", "2", "ok", "6"]
