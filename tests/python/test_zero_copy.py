"""Batches are read in place (their data lie inside the reader's payload
mapping) and cannot be written: numpy arrays are read-only, torch tensors
raise ReadOnlyBatchError on in-place operations, DLPack capsules follow the
protocol."""

import ctypes

import numpy as np
import pytest
import torch
import tsock


def payload_range(consumer):
    """[start, end) of the consumer's mapping, asked from the C library."""
    r = consumer._reader
    base, length = ctypes.c_void_p(), ctypes.c_uint64()
    assert r.lib.tsock_reader_payload_range(r.handle, ctypes.byref(base), ctypes.byref(length)) == 0
    return base.value, base.value + length.value


def data_ptr(x):
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0]
    if isinstance(x, torch.Tensor):
        return x.data_ptr()
    return x.unsafe_buffer_pointer()  # jax


def batches(n=6, rows=8):
    return [
        (np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + 100 * i, np.arange(rows, dtype=np.int32) + rows * i)
        for i in range(n)
    ]


@pytest.mark.parametrize("output", ["numpy", "torch", "jax"])
def test_batches_lie_inside_the_mapping(channel, run_producer, output):
    run_producer(tsock.Producer(batches(), channel, slots=4, wait_readers=1))
    with tsock.Consumer(channel, output=output, timeout=10) as c:
        start, end = payload_range(c)
        n = 0
        for i, (x, y) in enumerate(c):
            for leaf in (x, y):
                assert start <= data_ptr(leaf) < end
            np.testing.assert_array_equal(np.asarray(x.numpy() if output == "torch" else x), batches()[i][0])
            n += 1
        assert n == 6


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_rebatched_slices_are_zero_copy_and_straddling_batches_are_copies(channel, run_producer, output):
    # Producer batches of 8 rows, consumer batches of 3: [0:3] [3:6] inside
    # batch 0, [6:9] straddles batches 0 and 1.
    run_producer(tsock.Producer(batches(2), channel, slots=4, wait_readers=1))
    with tsock.Consumer(channel, output=output, batch_size=3, timeout=10) as c:
        start, end = payload_range(c)
        it = iter(c)
        for want_inside in (True, True, False):
            x, y = next(it)
            assert (start <= data_ptr(x) < end) == want_inside
            assert (start <= data_ptr(y) < end) == want_inside


def _jax_copies_unaligned_dlpack() -> bool:
    """JAX newer than 0.4.30 copies a DLPack import whose data do not start
    on a 64-byte boundary."""
    import jax

    return tuple(int(p) for p in jax.__version__.split(".")[:3]) > (0, 4, 30)


@pytest.mark.parametrize("batch_size", [3, 4])
def test_jax_rebatched_slices_are_zero_copy_where_jax_allows(channel, run_producer, batch_size):
    # x has 16-byte rows, y 4-byte rows; each leaf starts on 64 bytes in its
    # slot. A slice starting at row r of a leaf is at r * row bytes: newer
    # JAX takes it in place only when that is a multiple of 64, and copies
    # it otherwise (XLA also refuses padded rows, so the producer cannot
    # align them). Batches straddling producer batches are always copies.
    run_producer(tsock.Producer(batches(2, rows=8), channel, slots=4, wait_readers=1))
    strict = _jax_copies_unaligned_dlpack()
    with tsock.Consumer(channel, output="jax", batch_size=batch_size, timeout=10) as c:
        start, end = payload_range(c)
        first = 0
        for i, (x, y) in enumerate(c):
            inside = first + batch_size <= 8 * (first // 8 + 1)  # not straddling
            for leaf, row_bytes in ((x, 16), (y, 4)):
                aligned = (first % 8) * row_bytes % 64 == 0
                want = inside and (aligned or not strict)
                assert (start <= data_ptr(leaf) < end) == want, (i, row_bytes)
            np.testing.assert_array_equal(np.asarray(y), np.arange(first, min(first + batch_size, 16)))
            first += batch_size


def test_numpy_batches_are_read_only(channel, run_producer):
    run_producer(tsock.Producer(batches(2), channel, slots=4, wait_readers=1))
    with tsock.Consumer(channel, timeout=10) as c:
        for x, y in c:
            assert not x.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                x[0, 0] = 1
            with pytest.raises(ValueError):
                x.flags.writeable = True
            y2 = y.copy()
            y2[0] = -1  # a copy is the caller's


def _inplace_writes():
    return {
        "add_": lambda x: x.add_(1),
        "setitem": lambda x: x.__setitem__(0, 1),
        "iadd": lambda x: x.__iadd__(1),
        "zero_": lambda x: x.zero_(),
        "copy_": lambda x: x.copy_(torch.zeros_like(x)),
        "out=": lambda x: torch.add(torch.ones_like(x), 1, out=x),
        "relu(inplace=True)": lambda x: torch.nn.functional.relu(x, inplace=True),
        "init.zeros_": lambda x: torch.nn.init.zeros_(x),
        "view then add_": lambda x: x[0].add_(1),
        "reshape then fill_": lambda x: x.reshape(-1).fill_(0),
    }


@pytest.mark.parametrize("copy", [False, True])
def test_torch_batches_refuse_in_place_writes(channel, run_producer, copy):
    data = batches(1)
    run_producer(tsock.Producer(data, channel, slots=4, wait_readers=2))
    with (
        tsock.Consumer(channel, output="torch", copy=copy, timeout=10) as c,
        tsock.Consumer(channel, timeout=10) as other,
    ):
        x, y = next(iter(c))
        if copy:
            assert type(x) is torch.Tensor
            x.add_(1)  # a private copy
        else:
            assert isinstance(x, tsock._torch.ReadOnlyTensor)
            for what, write in _inplace_writes().items():
                with pytest.raises(tsock.ReadOnlyBatchError):
                    write(x)
                    pytest.fail(f"{what} did not raise")
            # Reading works as usual, and results are ordinary tensors.
            model = torch.nn.Linear(4, 2)
            out = model(x)
            assert out.shape == (8, 2) and type(out) is torch.Tensor
            z = x + 1
            assert type(z) is torch.Tensor
            z.add_(1)
            assert torch.equal(z, x + 2)
            w = x.clone()
            w[0] = 7
            assert not x.numpy().flags.writeable
            assert y.sum().item() == sum(range(8))
            # the in-place attempts changed nothing, here or for other readers
            assert torch.equal(x, torch.from_numpy(data[0][0]))
        ox, oy = next(iter(other))
        np.testing.assert_array_equal(ox, data[0][0])


def test_dlpack_output_speaks_the_protocol(channel, run_producer):
    data = batches(2)
    run_producer(tsock.Producer(data, channel, slots=4, wait_readers=1))
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    with tsock.Consumer(channel, output="dlpack", timeout=10, lifetime="step") as c:
        it = iter(c)
        x, y = next(it)
        assert x.__dlpack_device__() == (1, 0)
        assert name(x.__dlpack__()) == b"dltensor"
        assert name(x.__dlpack__(max_version=(1, 0))) == b"dltensor_versioned"
        # Unconsumed capsules free their struct through the capsule destructor
        # (tsock_dlpack_delete): the C library counts none of them alive after.
        batch = tsock._capi.Batch.from_address(x._lease.batch)
        for _ in range(1000):
            x.__dlpack__(max_version=(1, 2))
            x.__dlpack__()
        assert batch.dlpack_live[tsock._capi.MAX_TENSORS] == 0
        a = np.from_dlpack(x)
        assert batch.dlpack_live[0] == 1  # the array holds its descriptor
        assert not a.flags.writeable
        np.testing.assert_array_equal(a, data[0][0])
        t = torch.utils.dlpack.from_dlpack(y)
        assert torch.equal(t, torch.from_numpy(data[0][1]))
        with pytest.raises(BufferError):
            x.__dlpack__(copy=True)
        next(it)
        with pytest.raises(BufferError, match="released"):
            x.__dlpack__()  # the batch was released when the next one was taken


def test_a_batch_released_under_an_export_raises_buffer_error(channel, run_producer):
    """The release can land between the Python check and the C export (a
    thread exporting while the loop moves on): the C refusal (ESTATE) is
    the same BufferError (it was a TsockError naming a C function, review
    26)."""
    run_producer(tsock.Producer(batches(3), channel, slots=4, wait_readers=1))
    with tsock.Consumer(channel, output="dlpack", timeout=10, lifetime="step") as c:
        x, _ = next(iter(c))
        reader = c._reader
        assert reader.lib.release(reader.handle, x._lease.held) == 0  # behind the consumer's back
        assert x._lease.valid
        with pytest.raises(BufferError, match="released"):
            np.from_dlpack(x)


def test_a_failed_release_still_invalidates_the_batches(channel, run_producer):
    """A release that fails (an eviction: the producer may be rewriting
    those slots) still turns the released batches' leases invalid (before,
    they stayed valid and an export described another batch's data)."""
    run_producer(tsock.Producer(batches(3), channel, slots=4, wait_readers=1))
    with tsock.Consumer(channel, output="dlpack", timeout=10, lifetime="step") as c:
        it = iter(c)
        x, _ = next(it)
        reader = c._reader
        real = reader.lib.release

        def evicted(handle, held):
            real(handle, held)
            return tsock._capi.EEVICTED

        reader.lib.release = evicted
        try:
            with pytest.raises(tsock.TsockError):
                next(it)
        finally:
            reader.lib.release = real
        assert not x._lease.valid
        with pytest.raises(BufferError, match="released"):
            np.from_dlpack(x)


def test_assembled_torch_batches_are_guarded_too(channel, run_producer):
    # Rows 6..8 straddle two producer batches: a private copy, but guarded
    # like every other batch so code behaves the same at every step.
    run_producer(tsock.Producer(batches(2), channel, slots=4, wait_readers=1))
    with tsock.Consumer(channel, output="torch", batch_size=3, timeout=10) as c:
        start, end = payload_range(c)
        it = iter(c)
        next(it), next(it)
        x, y = next(it)
        assert not start <= x.data_ptr() < end
        for write in (lambda: x.add_(1), lambda: x[0].add_(1), lambda: y.__setitem__(0, 5)):
            with pytest.raises(tsock.ReadOnlyBatchError):
                write()
        assert type(x + 1) is torch.Tensor
        assert y.tolist() == [6, 7, 8]


@pytest.mark.parametrize("output", ["numpy", "torch", "jax"])
def test_batches_kept_after_close_never_fault(spawn, channel, output):
    """A trainer that keeps a batch past close() (against the docs) reads
    stale bytes, it is not killed: the mapping stays until the last array
    goes. Run in a child so that a fault would fail the test, not pytest."""
    p = spawn(
        """
        import sys, threading
        import numpy as np, tsock
        name, output = sys.argv[1], sys.argv[2]
        data = [(np.full((4, 4), i, np.float32),) for i in range(3)]
        prod = tsock.Producer(data, name, slots=4, wait_readers=1)
        t = threading.Thread(target=prod.run)
        t.start()
        c = tsock.Consumer(name, output=output, timeout=10)
        kept = [b[0] for b in c]
        c.close()
        t.join()
        prod.close()
        print(float(np.asarray(kept[-1]).sum()))
        """,
        channel,
        output,
    )
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert float(out.strip()) == 2 * 16


LATE_CAPSULE = """
import sys, threading
import numpy as np, tsock
from tsock._dlpack import capsule

name, where = sys.argv[1], sys.argv[2]
p = tsock.Producer([(np.arange(32, dtype=np.int32).reshape(8, 4),)] * 2, name, slots=4, wait_readers=1)
threading.Thread(target=p.run, daemon=True).start()
c = tsock.Consumer(name, output="dlpack", timeout=30, lifetime="step")
it = iter(c)
(x,) = next(it)
late = capsule(x._lib, x._lease, 0, where != "sys-legacy")  # never consumed
setattr(np if where == "numpy" else sys, "_tsock_late_capsule", late)
del x, late
for _ in it:
    pass
c.close()
p.close()
print("end", flush=True)
"""


@pytest.mark.parametrize("where", ["sys", "sys-legacy", "numpy"])
def test_a_capsule_left_until_shutdown_is_freed_without_a_crash(spawn, channel, where):
    # An unconsumed capsule held where the interpreter clears late at exit
    # (sys, a module imported before tsock) is destroyed after tsock's
    # modules: its destructor crashed the process there (SIGSEGV or SIGILL,
    # review 25), as the ctypes callback had been freed with them.
    proc = spawn(LATE_CAPSULE, channel, where)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out == "end\n", (proc.returncode, out, err[-2000:])
