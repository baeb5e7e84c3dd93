"""Batch structure: flattening, the metadata encoding, and round trips of
nested batches through a channel for every output kind."""

import numpy as np
import pytest
import tsock
from tsock import _structure


def _as_numpy(x):
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "numpy") and not hasattr(x, "block_until_ready"):
        return x.numpy()
    return np.asarray(x)


def _same(a, b):
    """Structure and values equal; containers compared by exact type."""
    assert type(a) is type(b) or not isinstance(a, (tuple, list, dict)), (type(a), type(b))
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    else:
        np.testing.assert_array_equal(_as_numpy(a), _as_numpy(b))


def test_flatten_spec_and_leaf_order():
    a, b, c, d = (np.zeros(1) for _ in range(4))
    spec, leaves = _structure.flatten({"img": (a, [b, c]), "y": d})
    assert spec == '{"img"(.[..])"y".}'
    assert [id(x) for x in leaves] == [id(a), id(b), id(c), id(d)]
    assert _structure.flatten(a) == (".", [a])


def test_encode_decode_round_trip():
    batch = {"a": (1, 2), "b": [3, {"é": 4}]}
    spec, leaves = _structure.flatten(batch)
    meta = _structure.encode(spec, 10, 95)
    layout = _structure.decode(meta, len(leaves))
    assert (layout.batches, layout.samples) == (10, 95)
    assert layout.build(leaves) == batch
    unknown = _structure.decode(_structure.encode(spec, None, None), len(leaves))
    assert (unknown.batches, unknown.samples) == (None, None)


def test_foreign_metadata_gives_flat_layout():
    assert _structure.decode(b"", 1).build(["x"]) == "x"
    assert _structure.decode(b"something else", 2).build(["x", "y"]) == ("x", "y")


def test_corrupt_metadata_is_reported():
    meta = _structure.encode("(..", 1, 1)
    with pytest.raises(tsock.CorruptSegment):
        _structure.decode(meta, 2)


def test_structure_too_big_for_metadata():
    batch = {f"key_number_{i:04d}_with_a_long_name": np.zeros(1) for i in range(10)}
    spec, _ = _structure.flatten(batch)
    with pytest.raises(tsock.BatchTooLarge, match="metadata"):
        _structure.encode(spec, None, None)


def test_non_string_dict_keys_are_refused():
    with pytest.raises(TypeError, match="keys must be str"):
        _structure.flatten({1: np.zeros(1)})


def test_leaf_path_names_the_leaf():
    batch = {"x": (np.zeros(1), [np.zeros(1), "text"])}
    assert _structure.leaf_path(batch, 2) == "batch['x'][1][1]"


NESTINGS = {
    "array": lambda a, b, c: a,
    "tuple": lambda a, b, c: (a, b),
    "list": lambda a, b, c: [a, b, c],
    "dict": lambda a, b, c: {"image": a, "label": b},
    "nested": lambda a, b, c: {"x": (a, [b, {"deep": c}]), "y": [c]},
}


@pytest.mark.parametrize("output", ["numpy", "torch", "jax"])
def test_nested_batches_round_trip(channel, run_producer, output):
    batches = []
    for i in range(len(NESTINGS)):
        a = np.arange(12, dtype=np.float32).reshape(3, 4) + i
        b = np.arange(3, dtype=np.int32) * i
        c = np.ones((3, 2, 2), dtype=np.uint8) * i
        batches.append([make(a, b, c) for make in NESTINGS.values()][i])
    # One structure per channel: a producer sizes and describes each batch on its own.
    run_producer(tsock.Producer(batches, channel, slots=8, wait_readers=1, slot_bytes=1 << 16))
    with tsock.Consumer(channel, output=output, timeout=10) as c:
        n = 0
        for want, have in zip(batches, c):
            _same(want, have)  # a batch is valid until the next one is taken
            n += 1
        assert n == len(batches)
