"""The bytes of a cached sample (tsock._cache_codec): what round-trips,
what is refused, and that no corruption of the bytes gets past decode()
as anything but CorruptSample."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tsock._cache_codec import NUMPY_DTYPES, CorruptSample, Uncacheable, decode, encode, prepare


def same(a, b) -> None:
    """a and b are equal in type, structure, dtype, shape, order and bytes."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert (a.dtype, a.shape, a.flags.writeable) == (b.dtype, b.shape, b.flags.writeable)
        if a.size:  # the memory order (the strides of the axes longer than 1): what a reduction follows
            assert [t for n, t in zip(a.shape, a.strides) if n > 1] == [t for n, t in zip(b.shape, b.strides) if n > 1]
        assert a.tobytes(order="A") == b.tobytes(order="A")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    elif type(a).__name__ == "Tensor":
        assert a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    else:
        assert a == b


SAMPLES = [
    None,
    (np.arange(12, dtype=np.float32).reshape(3, 4), 7),
    {"img": np.zeros((2, 0, 3), np.uint8), "label": -3, "name": "é☃", "raw": b"\0\1", "ok": True, "x": 1.5},
    [np.float32(2.5), np.int64(-1), np.bool_(True), [None, False, ()], {3: "three", "t": (1, 2)}],
    np.asfortranarray(np.arange(24, dtype=np.int16).reshape(2, 3, 4)),
    np.arange(24, dtype=np.float32).reshape(2, 3, 4).transpose(2, 0, 1),  # HWC -> CHW: a permutation
    np.arange(24, dtype=np.uint8).reshape(2, 3, 4)[:, ::-1, ::-1].transpose(1, 2, 0),  # flipped and permuted
    np.arange(6, dtype=np.int32).reshape(2, 3, 1).transpose(2, 0, 1),  # a dimension of 1
    np.frombuffer(bytes(range(8)), dtype=np.uint8),  # read-only
    np.array(5, dtype=np.uint64),  # 0-d
    tuple(np.ones(3, dt) for dt in NUMPY_DTYPES),
]


@pytest.mark.parametrize("sample", SAMPLES, ids=range(len(SAMPLES)))
def test_samples_round_trip(sample):
    got = decode(encode(sample))
    same(sample, got)


@pytest.mark.parametrize("sample", SAMPLES, ids=range(len(SAMPLES)))
def test_an_encoding_written_over_old_bytes_is_the_same_bytes(sample):
    """The store writes an encoding straight into blocks that held another
    sample: every byte, the alignment padding included, must be written."""
    enc = prepare(sample)
    clean = bytearray(len(enc))
    dirty = bytearray(b"\xa5" * len(enc))
    enc.into(clean)
    enc.into(np.frombuffer(dirty, dtype=np.uint8))
    assert dirty == clean == encode(sample)
    same(sample, decode(dirty))
    with pytest.raises(ValueError, match="bytes for an encoding"):
        enc.into(bytearray(len(enc) + 1))


def test_decoded_arrays_are_private_and_writable():
    buf = encode((np.arange(4, dtype=np.int32), np.arange(3.0)))
    a, b = decode(buf)
    a += 1
    b[:] = 0
    assert a.tolist() == [1, 2, 3, 4]
    assert decode(buf)[1].tolist() == [0.0, 0.0, 0.0]  # views of the buffer handed in, which is private


@pytest.mark.parametrize(
    "sample",
    [np.arange(10.0)[::3], np.broadcast_to(np.arange(3.0), (4, 3)), np.arange(24.0).reshape(4, 6)[:, :3]],
    ids=["step slice", "broadcast", "column slice"],
)
def test_an_array_whose_layout_cannot_be_kept_is_refused(sample):
    with pytest.raises(Uncacheable, match="ascontiguousarray"):
        encode(sample)


def test_a_transposed_float_array_gives_the_same_reductions():
    x = np.random.default_rng(0).random((64, 48, 3), dtype=np.float32).transpose(2, 0, 1)
    y = decode(encode(x))
    assert y.strides == x.strides
    assert (y / y.mean() * 0.5).tobytes() == (x / x.mean() * 0.5).tobytes()


def test_forged_bool_bytes_decode_to_0_and_1():
    buf = encode((np.array([True, False, True]), np.bool_(True)))
    data = bytes(buf).rindex(b"\1\0\1")
    buf[data : data + 3] = b"\x07\x00\xff"
    skel = bytes(buf).index(b"n\0")  # the scalar: code 0 (bool), then its byte
    buf[skel + 2] = 0x09
    arr, scalar = decode(buf)
    assert arr.view(np.uint8).tolist() == [1, 0, 1] and np.asarray(scalar).view(np.uint8) == 1


def test_torch_tensors_round_trip():
    torch = pytest.importorskip("torch")
    x = {"t": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    got = decode(encode(x))
    assert isinstance(got["t"], torch.Tensor) and got["b"].dtype == torch.bfloat16
    same(x, got)
    hwc = torch.rand(8, 6, 3)
    for t in (hwc.permute(2, 0, 1), hwc.to(torch.bfloat16).permute(2, 0, 1)):  # CHW views keep their strides
        got = decode(encode(t))
        assert got.stride() == t.stride() and got.dtype == t.dtype and bool((got == t).all())
    with pytest.raises(Uncacheable):
        encode(hwc[::2])


class Point:
    pass


@pytest.mark.parametrize(
    "sample",
    [Point(), {"a": object()}, 1 << 70, np.array(["a"]), np.arange(3, dtype=">i4"), np.ma.masked_array([1])],
    ids=["object", "nested object", "big int", "str array", "big endian", "masked array"],
)
def test_what_the_cache_does_not_store_is_refused(sample):
    with pytest.raises(Uncacheable):
        encode(sample)


def test_a_namedtuple_is_refused_rather_than_changed_into_a_tuple():
    from collections import namedtuple

    with pytest.raises(Uncacheable):
        encode(namedtuple("P", "x y")(1, 2))


def test_corrupt_bytes_give_corrupt_sample_and_nothing_else():
    rng = random.Random(1)
    good = bytes(encode(SAMPLES[2])) + bytes(encode(SAMPLES[3]))
    bases = [bytes(encode(s)) for s in SAMPLES]
    failures = 0
    for _ in range(3000):
        buf = bytearray(rng.choice(bases + [good]))
        how = rng.randrange(3)
        if how == 0:
            buf = buf[: rng.randrange(len(buf) + 1)]
        else:
            for _ in range(rng.randint(1, 4)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
        try:
            decode(buf)
        except CorruptSample:
            failures += 1
    assert failures > 500  # most corruptions are noticed; none raised anything else


@pytest.mark.parametrize(
    "buf,match",
    [
        (b"TSC", "shorter than a header"),
        (b"XXXX\0\0\0\0", "magic"),
        (b"TSC1\xff\0\0\0N", "skeleton of 255 bytes"),
        (b"TSC1\1\0\0\0Q", "unknown tag"),
        (b"TSC1\5\0\0\0l\xff\0\0\0", "a count of 255"),
    ],
)
def test_corrupt_bytes_are_named(buf, match):
    with pytest.raises(CorruptSample, match=match):
        decode(bytearray(buf))


def test_an_array_past_the_end_is_refused():
    buf = encode(np.arange(100, dtype=np.int64))
    with pytest.raises(CorruptSample, match="an array of 800 bytes"):
        decode(buf[:-8])
