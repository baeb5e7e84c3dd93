"""The cache key (review 31, F1): it follows the state and the code of the
source, read and decode, not their names, so that a dataset with other
settings, a closure over other values or an edited decode never gets
another's decoded samples from the cache."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import tsock

# The cache turning itself off is a failure here, except where a test expects it.
pytestmark = pytest.mark.usefixtures("cache_stays_on")


class Folder:
    """A dataset whose samples depend on its root (as a folder's files would)."""

    def __init__(self, root):
        self.root = root

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full(4, 1000 * len(self.root) + i, dtype=np.int64)


def ident(x):
    return x


def make_scale(k):
    def scale(x):
        return x * k

    return scale


class Scale:
    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        return x * self.k


def pipe(shm, source, decode, **kw):
    return tsock.Pipeline(source, decode=decode, batch_size=8, shuffle=False, cache_bytes=1 << 22, cache_dir=shm, **kw)


def first_batch(p):
    return np.asarray(next(iter(p)))


def test_datasets_of_one_class_and_length_with_other_settings_get_their_own_samples(shm):
    train, val = pipe(shm, Folder("/data/train"), ident), pipe(shm, Folder("/data/validation"), ident)
    assert train.cache_key() != val.cache_key()
    for _ in range(2):  # the second time from the cache
        assert first_batch(train)[:, 0].tolist() == [Folder("/data/train")[i][0] for i in range(8)]
        assert first_batch(val)[:, 0].tolist() == [Folder("/data/validation")[i][0] for i in range(8)]
    assert train.cache_stats()["hits"] == 8 and val.cache_stats()["hits"] == 8
    train.close(), val.close()


@pytest.mark.parametrize(
    "make",
    [make_scale, Scale, lambda k: functools.partial(np.multiply, k), lambda k: lambda x, k=k: x * k],
    ids=["closure", "callable-object", "partial", "default-argument"],
)
def test_a_decode_with_other_state_is_another_key(shm, make):
    two, three = pipe(shm, Folder("/x"), make(2)), pipe(shm, Folder("/x"), make(3))
    assert two.cache_key() != three.cache_key()
    assert two.cache_key() == pipe(shm, Folder("/x"), make(2)).cache_key()  # same state, same key
    assert first_batch(two)[:, 0].tolist() == [2 * Folder("/x")[i][0] for i in range(8)]
    assert first_batch(three)[:, 0].tolist() == [3 * Folder("/x")[i][0] for i in range(8)]
    two.close(), three.close()


OFFSET = 5


def uses_a_helper(x):
    return helper(x)


def helper(x):
    return x + OFFSET


def test_the_code_and_globals_a_decode_calls_are_in_the_key(shm, monkeypatch):
    before = pipe(shm, Folder("/x"), uses_a_helper).cache_key()
    monkeypatch.setattr(sys.modules[__name__], "OFFSET", 6)  # a global the helper reads
    assert pipe(shm, Folder("/x"), uses_a_helper).cache_key() != before
    monkeypatch.undo()
    monkeypatch.setattr(sys.modules[__name__], "helper", lambda x: x - OFFSET)  # the helper's code
    assert pipe(shm, Folder("/x"), uses_a_helper).cache_key() != before


def test_a_source_without_a_trustworthy_key_needs_a_version(shm):
    class Locked(Folder):
        def __init__(self, root):
            super().__init__(root)
            self.lock = threading.Lock()  # pickle cannot handle it

    with pytest.raises(ValueError, match="version="):
        pipe(shm, Locked("/x"), ident)
    p = pipe(shm, Locked("/x"), ident, version="locked-v1")
    assert p.cache_key() != pipe(shm, Locked("/x"), ident, version="locked-v2").cache_key()
    assert first_batch(p)[:, 0].tolist() == list(range(2000, 2008))
    p.close()
    tsock.Pipeline(Locked("/x"), batch_size=8)  # without a cache nothing is asked


JOB = """
import numpy as np, tsock
def decode(x):
    return x * {k}
p = tsock.Pipeline(list(range(6)), read=np.int64, decode=decode, batch_size=6, shuffle=False,
                   cache_bytes=1 << 22, cache_dir={shm!r}, cache_keep=True)
print(p.cache_key().hex(), np.asarray(next(iter(p))).tolist(), p.cache_stats()["hits"])
p.close()
"""


def test_an_edited_decode_does_not_get_the_samples_of_the_old_one(shm, tmp_path):
    def run(k):
        job = tmp_path / "job.py"
        job.write_text(textwrap.dedent(JOB.format(k=k, shm=shm)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # a new hash seed each run
        out = subprocess.run([sys.executable, str(job)], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        key, *rest = out.stdout.split(" ", 1)
        return key, rest[0].strip()

    key10, got = run(10)
    assert got == "[0, 10, 20, 30, 40, 50] 0"
    assert run(10) == (key10, "[0, 10, 20, 30, 40, 50] 6")  # unchanged: the same key in a new process, warm
    key100, got = run(100)
    assert key100 != key10 and got == "[0, 100, 200, 300, 400, 500] 0"


# Review 33, K1: what decides the samples besides the instance's state and
# the functions' own globals. Each case builds pipeline A, reads a batch (the
# cache fills), changes one thing and builds B while A is open (a second
# trainer): B must get another key and its own samples.


class Scaled:
    SCALE = 10

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full(2, i * self.SCALE, dtype=np.int64)


class Base:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full(2, i * 10, dtype=np.int64)


class Child(Base):
    pass


def _getitem_100(self, i):
    return np.full(2, i * 100, dtype=np.int64)


class WithTransform:
    transform = Scale(10)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.transform(np.full(2, i, dtype=np.int64))


def _lru_decode(k):
    @functools.lru_cache(maxsize=64)
    def cached_decode(x):
        return np.int64(x) * k

    return cached_decode


HELPERS = "def scale(x):\n    return x * {k}\n"
r33helpers = None  # a user module, imported by the module-attribute case


def decode_via_module(x):
    return r33helpers.scale(x)


def _module_case(tmp_path, monkeypatch):
    import importlib

    path = tmp_path / "r33helpers.py"
    path.write_text(HELPERS.format(k=10))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "r33helpers", raising=False)
    mod = importlib.import_module("r33helpers")
    monkeypatch.setitem(globals(), "r33helpers", mod)

    def edit():
        path.write_text(HELPERS.format(k=100))
        os.utime(path, (1, 1e9 + 5))
        importlib.invalidate_caches()
        importlib.reload(mod)

    return (lambda: (Folder("/x"), decode_via_module)), edit, (lambda: (Folder("/x"), decode_via_module))


def _cases(tmp_path, monkeypatch):
    """name -> (make A's (source, decode), change, make B's)."""
    lru = {"first": _lru_decode(10)}
    return {
        "class-attribute": (
            lambda: (Scaled(), ident),
            lambda: monkeypatch.setattr(Scaled, "SCALE", 100),
            lambda: (Scaled(), ident),
        ),
        "inherited-method": (
            lambda: (Child(), ident),
            lambda: monkeypatch.setattr(Base, "__getitem__", _getitem_100),
            lambda: (Child(), ident),
        ),
        "module-attribute": _module_case(tmp_path, monkeypatch),
        "lru-cache": (
            lambda: (list(range(8)), lru["first"]),
            lambda: lru.update(second=_lru_decode(100)),
            lambda: (list(range(8)), lru["second"]),
        ),
        "class-level-transform": (
            lambda: (WithTransform(), ident),
            lambda: monkeypatch.setattr(WithTransform, "transform", Scale(100)),
            lambda: (WithTransform(), ident),
        ),
    }


@pytest.mark.parametrize(
    "case", ["class-attribute", "inherited-method", "module-attribute", "lru-cache", "class-level-transform"]
)
def test_what_the_code_reads_beyond_the_state_is_in_the_key(shm, tmp_path, monkeypatch, case):
    make_a, change, make_b = _cases(tmp_path, monkeypatch)[case]
    a = pipe(shm, *make_a())
    assert a.cache_key() == pipe(shm, *make_a()).cache_key()  # unchanged: the same key
    first_batch(a)  # fills the cache
    change()
    source, decode = make_b()
    b = pipe(shm, source, decode)
    truth = [int(np.asarray(decode(source[i])).reshape(-1)[0]) for i in range(8)]
    assert b.cache_key() != a.cache_key()
    assert first_batch(b).reshape(8, -1)[:, 0].tolist() == truth
    a.close(), b.close()


CLASS_JOB = """
import numpy as np, tsock
class DS:
    SCALE = {k}
    def __len__(self): return 6
    def __getitem__(self, i): return np.int64(i * self.SCALE)
p = tsock.Pipeline(DS(), batch_size=6, shuffle=False, cache_bytes=1 << 22, cache_dir={shm!r}, cache_keep=True)
print(p.cache_key().hex(), np.asarray(next(iter(p))).tolist(), p.cache_stats()["hits"])
p.close()
"""


def _run_job(tmp_path, text, seed=None):
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(text))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    if seed is not None:
        env["PYTHONHASHSEED"] = str(seed)
    out = subprocess.run([sys.executable, str(job)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_an_edited_class_constant_does_not_get_the_samples_of_the_old_one(shm, tmp_path):
    def run(k):
        key, rest = _run_job(tmp_path, CLASS_JOB.format(k=k, shm=shm)).split(" ", 1)
        return key, rest

    key10, got = run(10)
    assert got == "[0, 10, 20, 30, 40, 50] 0"
    assert run(10) == (key10, "[0, 10, 20, 30, 40, 50] 6")  # the same key in a new process: warm
    key100, got = run(100)
    assert key100 != key10 and got == "[0, 100, 200, 300, 400, 500] 0"


# Review 33, K2: state whose pickle differs between processes (a set in
# string-hash order, a tensor through torch.save's serialization id) must
# still give one key, or trainers never share the cache.

STATE_JOB = """
import numpy as np, tsock
try:
    import torch
except ImportError:
    torch = None
class DS:
    def __init__(self, k):
        self.exts = {{".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".webp"}}
        self.pairs = frozenset({{("a", 1), ("b", 2), ("c", 3)}})
        self.mixed = {{"x", 1, None}}
        self.array = np.arange(5, dtype=np.float32) * k
        self.mean = None if torch is None else torch.tensor([0.485, 0.456, 0.406]) * k
    def __len__(self): return 6
    def __getitem__(self, i): return np.float32(i)
def key(k):
    return tsock.Pipeline(DS(k), batch_size=6, cache_bytes=1 << 22, cache_dir={shm!r}).cache_key().hex()
print(key(1), key(1), key(2))
"""


def test_set_tensor_and_array_state_gives_one_key_in_every_process(shm, tmp_path):
    runs = [_run_job(tmp_path, STATE_JOB.format(shm=shm), seed=seed).split() for seed in (1, 2, 3)]
    for same, same_again, other in runs:
        assert same == same_again  # two equal datasets in one process
        assert other != same  # other array and tensor values
    assert runs[0] == runs[1] == runs[2]  # other hash seeds


def test_a_tensor_is_keyed_by_its_values_dtype_and_shape():
    torch = pytest.importorskip("torch")
    from tsock._cache_key import state_digest

    t = torch.arange(6, dtype=torch.float32)
    d = state_digest(t)
    assert state_digest(torch.arange(6, dtype=torch.float32)) == d
    assert state_digest(t.clone().add_(1)) != d
    assert state_digest(t.to(torch.float64)) != d
    assert state_digest(t.reshape(2, 3)) != d
    assert state_digest(torch.arange(6, dtype=torch.bfloat16)) == state_digest(torch.arange(6, dtype=torch.bfloat16))
    assert state_digest({"a", "b"}) == state_digest({"b", "a"}) != state_digest({"a", "c"})
