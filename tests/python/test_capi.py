"""python/tsock/_capi.py against include/tsock.h: every constant the header
defines (#define and enum members, TSOCK_ dropped) stands in _capi with the
same value, and _capi defines no constant the header lacks. The constants
are written in Python by hand because an installed wheel carries no header
to read them from; this test is what keeps the two in step."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from tsock import _capi

HEADER = Path(__file__).resolve().parents[2] / "include" / "tsock.h"
DEFAULTS = Path(__file__).resolve().parents[2] / "producer" / "defaults.h"

# `#define TSOCK_X value` (a number, maybe with a u suffix) and enum members
# `TSOCK_X = value`; the include guard (no value) is not a constant.
_DEFINE = re.compile(r"^\s*#define[ \t]+TSOCK_(\w+)[ \t]+(-?(?:0x[0-9a-fA-F]+|\d+))[uUlL]*\b", re.M)
_ENUM_MEMBER = re.compile(r"^\s*TSOCK_(\w+)\s*=\s*(-?(?:0x[0-9a-fA-F]+|\d+))[uUlL]*\s*,?", re.M)


def header_constants(text: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for pattern in (_DEFINE, _ENUM_MEMBER):
        for name, value in pattern.findall(text):
            assert name not in found, f"TSOCK_{name} defined twice in tsock.h"
            found[name] = int(value, 0)
    return found


def capi_constants() -> dict[str, int]:
    return {
        name: value
        for name, value in vars(_capi).items()
        if re.fullmatch(r"[A-Z][A-Z0-9_]*", name) and type(value) is int
    }


def disagreements(header: dict[str, int], capi: dict[str, int]) -> list[str]:
    out = [f"TSOCK_{n} = {v} is missing from _capi.py" for n, v in header.items() if n not in capi]
    out += [f"{n} = {v} in _capi.py is not in tsock.h" for n, v in capi.items() if n not in header]
    out += [f"{n}: tsock.h says {header[n]}, _capi.py {capi[n]}" for n in header if n in capi and header[n] != capi[n]]
    return out


def test_header_is_parsed():
    # The parser must see what the header holds, or the comparison below
    # would pass on an empty list: the 23 status codes, 13 dtypes, limits.
    found = header_constants(HEADER.read_text())
    assert sum(1 for n, v in found.items() if n.startswith("E") and v < 0) == 23
    assert sum(1 for n in found if n.startswith("DTYPE_")) == 13
    assert found["NAME_MAX"] == 64 and found["MAX_DIMS"] == 8 and found["BATCH_EPOCH_END"] == 1


def test_capi_matches_header():
    problems = disagreements(header_constants(HEADER.read_text()), capi_constants())
    assert not problems, "_capi.py and include/tsock.h disagree:\n  " + "\n  ".join(problems)


def test_comparison_sees_each_kind_of_difference():
    header = {"MAX_DIMS": 8, "EAGAIN": -1}
    assert disagreements(header, {"MAX_DIMS": 8, "EAGAIN": -1}) == []
    assert disagreements(header, {"MAX_DIMS": 9, "EAGAIN": -1}) == ["MAX_DIMS: tsock.h says 8, _capi.py 9"]
    assert disagreements(header, {"MAX_DIMS": 8}) == ["TSOCK_EAGAIN = -1 is missing from _capi.py"]
    extra = {"MAX_DIMS": 8, "EAGAIN": -1, "EXTRA": 3}
    assert disagreements(header, extra) == ["EXTRA = 3 in _capi.py is not in tsock.h"]


def test_tensor_struct_is_tsock_tensor_t():
    # The struct format the producer packs and the reader unpacks is the
    # ctypes Tensor, field by field.
    assert _capi.TENSOR_STRUCT.size == ctypes.sizeof(_capi.Tensor)
    t = _capi.Tensor(dtype=3, ndim=2, offset=64, nbytes=24, data=0x1000)
    t.shape[0], t.shape[1], t.strides[0], t.strides[1] = 2, 3, 3, 1
    fields = _capi.TENSOR_STRUCT.unpack(bytes(t))
    assert fields[:2] == (3, 2)
    assert fields[2:4] == (2, 3) and fields[2 + _capi.MAX_DIMS : 4 + _capi.MAX_DIMS] == (3, 1)
    assert fields[-3:] == (64, 24, 0x1000)


def defaults_h(text: str) -> dict[str, int]:
    """producer/defaults.h's `#define TSOCK_DEFAULT_X value`: a number (C
    octal, u suffix) or a parenthesised shift."""
    found = {}
    for name, value in re.findall(r"^#define[ \t]+TSOCK_DEFAULT_(\w+)[ \t]+([^/\n]+?)\s*(?:/\*.*)?$", text, re.M):
        value = re.sub(r"(\d)[uU]\b", r"\1", value)
        value = re.sub(r"\b0([0-7]+)\b", r"0o\1", value)
        assert re.fullmatch(r"[\d\sxXoO()<]+", value), f"TSOCK_DEFAULT_{name}: cannot read {value!r}"
        found[name] = eval(value, {"__builtins__": {}})
    return found


def test_producer_defaults_match_defaults_h():
    found = defaults_h(DEFAULTS.read_text())
    assert set(found) == {"SLOT_COUNT", "SLOT_BYTES", "MAX_READERS", "MODE"}, found
    assert found == _capi.PRODUCER_DEFAULTS, f"producer/defaults.h {found} vs _capi.PRODUCER_DEFAULTS"


def test_producer_defaults_are_the_library_s(channel):
    # What tsock_producer_options_init writes (from defaults.h) is what the
    # Python mirror says, and a Producer given none gets them.
    import numpy as np
    import pytest
    import tsock
    from tsock.producer import _option_defaults, library

    opts = _option_defaults(library())
    assert (opts.slot_count, opts.slot_bytes, opts.max_readers, opts.mode) == tuple(
        _capi.PRODUCER_DEFAULTS[k] for k in ("SLOT_COUNT", "SLOT_BYTES", "MAX_READERS", "MODE")
    )
    with tsock.Producer(None, channel) as p:
        assert (p.slots, p.max_readers) == (16, 64)
        p.publish(np.zeros(4))
    with pytest.raises(ValueError, match=r"join_window must be in 0\.\.slots-1 \(15\)"):
        tsock.Producer(None, channel, join_window=16)


def test_a_join_window_past_the_default_ring_stops_the_pipeline_workers(channel):
    # With a Pipeline, the workers start before the library (and so the
    # default ring size) is loaded; the join window refused then must not
    # leave them running.
    import pytest
    import tsock
    from pipeline_helpers import make_pipeline, wait_gone

    def children() -> set[int]:
        pids = set()
        for task in Path("/proc/self/task").iterdir():
            pids.update(int(p) for p in (task / "children").read_text().split())
        return pids

    before = children()
    pipe = make_pipeline(workers=2)
    with pytest.raises(ValueError, match=r"join_window must be in 0\.\.slots-1 \(15\)"):
        tsock.Producer(pipe, channel, join_window=16)
    left = wait_gone(children() - before)
    assert not left, f"the pipeline's workers were left running: {left}"
