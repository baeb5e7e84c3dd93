"""python/tsock/_capi.py against include/tsock.h: every constant the header
defines (#define and enum members, TSOCK_ dropped) stands in _capi with the
same value, and _capi defines no constant the header lacks; every function
the header declares is declared in _capi (in the producer's table for the
producer's section of the header, else in both libraries' table) with as
many arguments and the same kind of result, and no other. The constants
and prototypes are written in Python by hand because an installed wheel
carries no header to read them from; this test is what keeps the two in
step."""

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


# A declaration at the start of a line: its result type, name and
# parameters (which may span lines); comments never start a line with a type.
_FUNCTION = re.compile(r"^[A-Za-z_][\w \t*]*?\b(tsock_\w+)\(([^)]*)\);", re.M)
_RESULTS = {"int": ctypes.c_int, "void": None, "size_t": ctypes.c_size_t, "const char *": ctypes.c_char_p}
_PRODUCER_SECTION = ("/* ---- Producer (libtsock.so only)", "/* ---- Reader")


def header_functions(text: str) -> dict[str, tuple[object, int, bool]]:
    """name -> (ctypes result type, argument count, in the producer's section)."""
    begin, end = (text.index(mark) for mark in _PRODUCER_SECTION)
    found = {}
    for m in _FUNCTION.finditer(text):
        result = text[m.start() : m.start(1)].strip()
        assert result in _RESULTS, f"{m.group(1)}: result type {result!r} has no ctypes twin here"
        args = [a for a in m.group(2).split(",") if a.strip() not in ("", "void")]
        assert m.group(1) not in found, f"{m.group(1)} declared twice in tsock.h"
        found[m.group(1)] = (_RESULTS[result], len(args), begin < m.start() < end)
    return found


def function_disagreements(header: dict, common: dict, producer: dict) -> list[str]:
    out = []
    for name, (result, nargs, in_producer) in header.items():
        table, which = (producer, "_PRODUCER") if in_producer else (common, "_COMMON")
        if name not in table:
            out.append(f"{name} is missing from _capi.{which}")
            continue
        restype, argtypes = table[name]
        if restype is not result:
            out.append(f"{name}: tsock.h returns {result}, _capi.{which} {restype}")
        if len(argtypes) != nargs:
            out.append(f"{name}: tsock.h takes {nargs} arguments, _capi.{which} {len(argtypes)}")
    out += [f"{n} in _capi.py is not in tsock.h" for n in {**common, **producer} if n not in header]
    return out


def test_header_functions_are_parsed():
    found = header_functions(HEADER.read_text())
    assert len(found) >= 34
    assert found["tsock_batch_dlpack_export"] == (ctypes.c_int, 6, False)
    assert found["tsock_status_str"] == (ctypes.c_char_p, 1, False)
    assert found["tsock_producer_options_init"] == (None, 1, True)
    assert sum(1 for _, _, p in found.values() if p) == 11


def test_capi_declares_every_header_function():
    problems = function_disagreements(header_functions(HEADER.read_text()), _capi._COMMON, _capi._PRODUCER)
    assert not problems, "_capi.py and include/tsock.h disagree:\n  " + "\n  ".join(problems)


def test_function_comparison_sees_each_kind_of_difference():
    i = ctypes.c_int
    header = {"tsock_a": (i, 2, False), "tsock_p": (None, 1, True)}
    common, producer = {"tsock_a": (i, [i, i])}, {"tsock_p": (None, [i])}
    assert function_disagreements(header, common, producer) == []
    assert function_disagreements(header, {}, producer) == ["tsock_a is missing from _capi._COMMON"]
    assert function_disagreements(header, common, {"tsock_p": (None, [i])} | {"tsock_x": (i, [])}) == [
        "tsock_x in _capi.py is not in tsock.h"
    ]
    assert function_disagreements(header, {"tsock_a": (i, [i])}, producer) == [
        "tsock_a: tsock.h takes 2 arguments, _capi._COMMON 1"
    ]
    assert function_disagreements(header, {"tsock_a": (None, [i, i])}, producer) == [
        f"tsock_a: tsock.h returns {i}, _capi._COMMON None"
    ]
    assert function_disagreements(header, {**common, **producer}, {}) == ["tsock_p is missing from _capi._PRODUCER"]


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


# glibc gives a library flagged STATIC_TLS (libtsock.so: it holds the Go
# runtime) its thread-local storage from a reserve of about 1.6 KiB that
# every such library loaded later shares (libgomp among them): a library
# that takes most of it makes the next one fail to load with "cannot
# allocate memory in static TLS block" (review 34, B1: a 1 KiB per-thread
# table did). Kept well under half of it.
TLS_BUDGET = 0x300


def _tls_bytes(path: Path) -> int:
    """p_memsz of the PT_TLS program header of a 64-bit little-endian ELF
    file (0 without one)."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path}: not a 64-bit little-endian ELF"
    phoff = int.from_bytes(data[32:40], "little")
    phentsize, phnum = int.from_bytes(data[54:56], "little"), int.from_bytes(data[56:58], "little")
    for k in range(phnum):
        ph = data[phoff + k * phentsize : phoff + (k + 1) * phentsize]
        if int.from_bytes(ph[0:4], "little") == 7:  # PT_TLS
            return int.from_bytes(ph[40:48], "little")
    return 0


def test_the_library_leaves_room_in_the_static_tls_reserve():
    for name in ("libtsock.so", "libtsock_reader.so"):
        path = _capi._find(name)
        assert _tls_bytes(path) <= TLS_BUDGET, f"{name}: {_tls_bytes(path):#x} bytes of thread-local storage"
