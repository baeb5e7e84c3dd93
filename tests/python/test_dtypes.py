"""Every dtype tsock carries round-trips from numpy, torch and JAX sources to
numpy, torch and JAX outputs; what it cannot carry is refused clearly."""

import ml_dtypes
import numpy as np
import pytest
import torch
import tsock

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
]


def _np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def sample(name):
    """A 3x4 array whose values exercise the type (signs, high bits)."""
    if name == "bool":
        return (np.arange(12) % 3 == 0).reshape(3, 4)
    base = np.arange(12).reshape(3, 4)
    if name.startswith("int"):
        return (base - 6).astype(name) * (2 ** (8 * np.dtype(name).itemsize - 5))
    if name.startswith("uint"):
        return base.astype(name) + np.array(2 ** (8 * np.dtype(name).itemsize - 1), dtype=name)
    return ((base - 6) / 4).astype(_np_dtype(name))


def _publish_each(channel, run_producer, batches):
    run_producer(tsock.Producer(batches, channel, slots=4, wait_readers=1, slot_bytes=1 << 12))


def _to_numpy(x, name):
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def test_numpy_output_every_dtype(channel, run_producer):
    _publish_each(channel, run_producer, [(sample(n),) for n in DTYPES])
    with tsock.Consumer(channel, timeout=10) as c:
        for name, (x,) in zip(DTYPES, c):
            assert x.dtype == _np_dtype(name), name
            np.testing.assert_array_equal(x, sample(name))


def test_torch_output_every_dtype(channel, run_producer):
    _publish_each(channel, run_producer, [(sample(n),) for n in DTYPES])
    with tsock.Consumer(channel, output="torch", timeout=10) as c:
        it = iter(c)
        for name in DTYPES:
            want_dtype = getattr(torch, name, None)
            if not isinstance(want_dtype, torch.dtype):
                # torch 1.13 has no uint16/32/64: a clear error, and the
                # consumer goes on with the next batch.
                with pytest.raises(tsock.UnsupportedDtype, match=name):
                    next(it)
                continue
            (x,) = next(it)
            assert x.dtype == want_dtype, name
            np.testing.assert_array_equal(_to_numpy(x, name), sample(name))
        with pytest.raises(StopIteration):
            next(it)


def _jax_lacks_experimental_enable_x64() -> bool:
    from jax import experimental

    return not hasattr(experimental, "enable_x64")


@pytest.mark.xfail(
    _jax_lacks_experimental_enable_x64(),
    reason="issue 12 item 3 (consumer tests, not the stack): jax.experimental.enable_x64 is gone from current JAX",
    strict=True,
)
def test_jax_output_every_dtype_with_x64(channel, run_producer):
    from jax.experimental import enable_x64

    _publish_each(channel, run_producer, [(sample(n),) for n in DTYPES])
    with enable_x64(), tsock.Consumer(channel, output="jax", timeout=10) as c:
        for name, (x,) in zip(DTYPES, c):
            assert x.dtype == _np_dtype(name), name
            np.testing.assert_array_equal(np.asarray(x), sample(name))


def test_jax_output_through_the_array_api(channel, run_producer):
    # Without the XLA shortcut (newer JAX) leaves go through
    # jax.dlpack.from_dlpack(DLPackTensor): JAX >= 0.7.2 takes no bare capsule.
    names = ["float32", "int64", "uint8", "bool", "float64"]
    _publish_each(channel, run_producer, [(sample(n)[:2],) for n in names])
    with tsock.Consumer(channel, output="jax", timeout=10) as c:
        c._out._direct = None
        for name, (x,) in zip(names, c):
            want = sample(name)[:2]
            if name in ("int64", "float64"):  # no jax_enable_x64: 32 bits, as jnp.asarray
                want = want.astype(np.int32 if name == "int64" else np.float32)
            assert x.dtype == want.dtype, name
            np.testing.assert_array_equal(np.asarray(x), want)


def test_jax_output_without_x64_narrows_like_jax(channel, run_producer):
    import jax

    assert not jax.config.jax_enable_x64
    small = np.arange(-6, 6).reshape(3, 4)
    arrays = [small.astype(np.int64), small.astype(np.float64) / 4, small.astype(np.int32)]
    _publish_each(channel, run_producer, [(a,) for a in arrays])
    # copy=True: batches kept past the next one (and past close) must be copies.
    with tsock.Consumer(channel, output="jax", copy=True, timeout=10) as c:
        got = [x for (x,) in c]
    assert [str(x.dtype) for x in got] == ["int32", "float32", "int32"]
    for want, have in zip(arrays, got):
        np.testing.assert_array_equal(np.asarray(have), want)


def test_torch_sources_every_dtype(channel, run_producer):
    tensors = []
    for name in DTYPES:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            if name == "bfloat16":
                tensors.append(torch.from_numpy(sample("float32")).to(torch.bfloat16))
            else:
                tensors.append(torch.from_numpy(sample(name)))
    # Non-contiguous and requires_grad sources are copied right as well.
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    w = torch.ones(2, 3, requires_grad=True)
    _publish_each(channel, run_producer, [{"x": x} for x in tensors] + [{"x": t}, {"x": w}])
    with tsock.Consumer(channel, output="torch", copy=True, timeout=10) as c:
        got = [b["x"] for b in c]
    for want, have in zip(tensors + [t, w], got):
        assert have.dtype == want.dtype
        assert torch.equal(have, want.detach())


def test_jax_sources(channel, run_producer):
    import jax.numpy as jnp

    arrays = [jnp.arange(6, dtype=jnp.float32).reshape(2, 3), jnp.array([True, False]), jnp.ones(3, jnp.bfloat16)]
    _publish_each(channel, run_producer, [tuple(arrays)])
    with tsock.Consumer(channel, output="jax", timeout=10) as c:
        got = next(iter(c))
        for want, have in zip(arrays, got):
            assert have.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(have), np.asarray(want))


def test_byte_swapped_and_strided_numpy_sources(channel, run_producer):
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    strided = np.arange(20, dtype=np.float64).reshape(4, 5)[::2, 1::2]
    _publish_each(channel, run_producer, [(big, strided)])
    with tsock.Consumer(channel, timeout=10) as c:
        a, b = next(iter(c))
        assert a.dtype == np.dtype("int32")
        np.testing.assert_array_equal(a, big)
        np.testing.assert_array_equal(b, strided)


@pytest.mark.parametrize(
    "leaf, what",
    [
        (np.zeros(3, np.complex64), "complex64"),
        (np.array(["a", "b"]), "<U1"),
        (np.array([object(), 1], dtype=object), "object"),
        (torch.zeros(2, dtype=torch.complex64), "complex64"),
        ("a string", "str"),
        (3, "int"),
        (None, "NoneType"),
    ],
)
def test_unsupported_leaves_are_refused(channel, leaf, what):
    with tsock.Producer(None, channel) as p:
        with pytest.raises(tsock.UnsupportedDtype, match=what) as err:
            p.publish({"ok": np.zeros(2), "bad": leaf})
        assert "batch['bad']" in str(err.value)
        assert err.value.status == -15
        assert isinstance(err.value, TypeError)
        # Nothing was created or published by the failed batch.
        assert p.stats()["published"] == 0
