"""Consumer(device="cuda:N") without a GPU: the clear error where PyTorch has
no CUDA, tsock_reader_register_host through ctypes (no driver here; a fake
driver in a child process), and the copy scheduling with a fake CUDA
backend: copies of batch n+1 start before batch n is handed out, and no host
batch is released while a copy may still read it."""

import contextlib
import os
from pathlib import Path

import fakecuda
import numpy as np
import pytest
import torch
import tsock
from tsock import _backends, _capi, _devices, _torch

NO_CUDA = not torch.cuda.is_available()


def numbered(n_batches, rows=4):
    return [(np.arange(rows, dtype=np.int64) + rows * i, np.full((rows, 3), i, np.float32)) for i in range(n_batches)]


@pytest.mark.skipif(not NO_CUDA, reason="PyTorch has a GPU here")
def test_device_without_cuda_says_why():
    # Checked before attaching: no channel needed.
    with pytest.raises(tsock.CUDAUnavailable) as e:
        tsock.Consumer("no-such-channel", output="torch", device="cuda:0", timeout=0)
    assert e.value.status == _capi.ENOCUDA
    assert isinstance(e.value, tsock.TsockError) and isinstance(e.value, RuntimeError)
    assert "cuda:0" in str(e.value)
    assert ("built without CUDA" in str(e.value)) or ("sees no GPU" in str(e.value))
    assert tsock.errors.error_for(_capi.ENOCUDA, "x").__class__ is tsock.CUDAUnavailable


def test_device_needs_torch_output_and_a_cuda_device():
    with pytest.raises(ValueError, match="output='torch', 'jax' or 'dlpack'"):
        tsock.Consumer("no-such-channel", device="cuda:0", timeout=0)
    for bad in ("cpu", "meta", "gpu7", 3.5):
        with pytest.raises(ValueError, match="CUDA device"):
            tsock.Consumer("no-such-channel", output="torch", device=bad, timeout=0)


def _driver_installed() -> bool:
    import ctypes

    if os.environ.get("TSOCK_LIBCUDA"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_driver_installed(), reason="a CUDA driver is installed here")
def test_register_host_without_driver(channel, run_producer):
    run_producer(tsock.Producer(numbered(2), channel, wait_readers=1))
    with tsock.Consumer(channel, timeout=10) as c:
        lib = c._reader.lib
        assert lib.tsock_reader_register_host(c._reader.handle) == _capi.ENOCUDA
        assert "libcuda.so.1" in lib.tsock_last_error().decode()
        assert lib.tsock_status_str(_capi.ENOCUDA) == b"CUDA driver not available"
        assert len(list(c)) == 2  # the reader is unaffected


def _fake_driver() -> Path:
    return fakecuda.path()


@pytest.mark.skipif(not _fake_driver().is_file(), reason="fake CUDA driver not built (make build)")
def test_register_host_with_fake_driver(channel, spawn, monkeypatch):
    # Through ctypes, the payload range is pinned once, read-only, and
    # unpinned when the mapping goes (after the last view of it).
    code = """
        import ctypes, gc, sys, threading
        import numpy as np
        import tsock

        import fakecuda

        fake = ctypes.CDLL(sys.argv[2])
        stats = fakecuda.reader(fake)

        name = sys.argv[1]
        p = tsock.Producer([(np.arange(8),)] * 2, name, wait_readers=1)
        t = threading.Thread(target=p.run, daemon=True)
        t.start()
        # Registered by hand, behind the consumer's back: batches could not be
        # kept (the driver pinned the pages), so the old lifetime.
        c = tsock.Consumer(name, timeout=10, lifetime="step")
        lib, r = c._reader.lib, c._reader
        assert lib.tsock_reader_register_host(r.handle) == 0, lib.tsock_last_error()
        assert lib.tsock_reader_register_host(r.handle) == 0
        s = stats()
        assert (s.registers, s.registered_now, s.last_register_flags) == (1, 1, 0x09)
        assert (s.last_register_addr, s.last_register_len) == (r.base, r.length)
        batches = list(c)
        assert len(batches) == 2
        c.close()
        assert stats().unregisters == 0  # the batches still view the mapping
        del batches, c, r
        gc.collect()
        s = stats()
        assert (s.unregisters, s.registered_now, s.unregistered_after_unmap) == (1, 0, 0)
        assert (s.primary_refs, s.calls_without_context, s.init_calls) == (0, 0, 1)
        t.join(10)
        p.close()
        print("ok")
    """
    monkeypatch.setenv("TSOCK_LIBCUDA", str(_fake_driver()))
    proc = spawn(code, channel, _fake_driver())
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "ok"


class FakeEvent:
    def __init__(self, n, upto):
        self.n = n
        self.upto = upto  # copies issued before it


class FakeCuda:
    """A CUDA backend on the CPU. A copy's data move when its event is
    waited on (host) or handed out (stream order), as a DMA would finish
    some time after it was issued; every copy remembers whether the host
    knew it complete."""

    def __init__(self):
        self.log = []
        self.copies = []  # [src, dst, moved, host_synced, batch number]
        self.events = []
        self.in_stream = False
        self.registered = 0

    def register(self, reader):
        self.registered += 1
        return None

    @contextlib.contextmanager
    def on_stream(self):
        self.in_stream = True
        try:
            yield
        finally:
            self.in_stream = False

    def copy(self, host):
        assert self.in_stream, "copies run on the staging stream"
        assert type(host) is torch.Tensor
        dst = torch.empty_like(host)
        self.copies.append([host, dst, False, False, len(self.events)])
        self.log.append(("copy", len(self.events)))
        return dst

    def record(self):
        ev = FakeEvent(len(self.events), len(self.copies))
        self.events.append(ev)
        self.log.append(("record", ev.n))
        return ev

    def _finish(self, ev, host):
        for c in self.copies[: ev.upto]:
            if not c[2]:
                c[1].copy_(c[0])
                c[2] = True
            c[3] = c[3] or host

    def wait(self, ev):
        self.log.append(("wait", ev.n))
        self._finish(ev, True)

    def hand_out(self, ev, tensors):
        self.log.append(("hand_out", ev.n))
        assert all(any(t is c[1] for c in self.copies[: ev.upto]) for t in tensors)
        self._finish(ev, False)

    def unsynced(self):
        return [c[4] for c in self.copies if not c[3]]


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(_devices, "check_device", lambda device, output: "fake:0")
    monkeypatch.setattr(_backends, "backend", lambda device: fake)
    return fake


def _watch_releases(consumer, fake):
    """Fails the test if the C release runs while a copy is not known
    complete on the host."""
    reader = consumer._reader
    lib = reader.lib

    class Checked:
        def __getattr__(self, name):
            return getattr(lib, name)

        def release(self, handle, batch):
            assert fake.unsynced() == [], f"released a batch while copies {fake.unsynced()} may still read it"
            fake.log.append(("release",))
            return lib.release(handle, batch)

    reader.lib = Checked()


def test_copies_overlap_and_hold_the_host_batch(channel, run_producer, fake_cuda):
    fake = fake_cuda
    t = run_producer(tsock.Producer(numbered(5), channel, slots=2, wait_readers=1), epochs=2)
    with tsock.Consumer(channel, output="torch", device="cuda:0", timeout=10) as c:
        _watch_releases(c, fake)
        assert fake.registered == 1 and c.device == "fake:0"
        for epoch in range(2):
            got = []
            for k, (x, y) in enumerate(c):
                # Batch k was copied and handed out; batch k+1's copies were
                # started before it (the last batch's successor is the end).
                assert fake.log[-1] == ("hand_out", len(fake.events) - 2 if k < 4 else len(fake.events) - 1)
                if k < 4:
                    assert fake.log[-2] == ("record", len(fake.events) - 1)
                    assert fake.copies[-1][2] is False  # n+1 still "in flight"
                assert type(x) is torch.Tensor
                got.append(x.tolist())
                assert y.tolist() == [[float(k)] * 3] * 4
                x.add_(1)  # device tensors are private and writable
            assert got == [list(range(4 * k, 4 * k + 4)) for k in range(5)]
            assert c.epoch == epoch + 1
        with pytest.raises(tsock.ChannelClosed):
            next(iter(c))
    assert fake.unsynced() == []  # close waited for the last copies
    t.join()


def test_rebatching_on_the_device(channel, run_producer, fake_cuda):
    fake = fake_cuda
    run_producer(tsock.Producer(numbered(5), channel, slots=2, wait_readers=1))
    with tsock.Consumer(channel, output="torch", device="cuda", batch_size=3, timeout=10) as c:
        _watch_releases(c, fake)
        rows = [x.tolist() for x, _ in c]
    assert rows == [list(range(i, min(i + 3, 20))) for i in range(0, 20, 3)]
    assert len(fake.events) >= len(rows)


@pytest.mark.skipif(_capi.DTYPE_UINT16 in _torch.TO_TORCH, reason="this torch has uint16")
def test_errors_come_after_the_batches_before_them(channel, run_producer, fake_cuda):
    # Batch 2 has a dtype torch 1.13 lacks: the prefetch meets the error
    # while batch 1 is handed out; it is raised at the next call, as without
    # a device, not in place of batch 1.
    batches = [(np.arange(4),), (np.arange(4) + 4,), (np.arange(4, dtype=np.uint16),)]
    run_producer(tsock.Producer(batches, channel, wait_readers=1))
    with tsock.Consumer(channel, output="torch", device="cuda:0", timeout=10) as c:
        it = iter(c)
        assert next(it)[0].tolist() == [0, 1, 2, 3]
        assert next(it)[0].tolist() == [4, 5, 6, 7]
        with pytest.raises(tsock.UnsupportedDtype):
            next(it)
