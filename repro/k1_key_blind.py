"""Review 33, K1: things that decide the decoded samples and that the cache
key still cannot see. Each case builds pipeline A, reads a batch (the cache
fills), changes one thing, builds pipeline B *while A is open* (a second
trainer, or the next run with cache_keep=True) and compares B's first batch
with what B computes without a cache."""
import functools, importlib, os, sys, tempfile, warnings
import numpy as np, tsock

N = 6


def batch(p):
    b = np.asarray(next(iter(p)))
    return b.reshape(len(b), -1)[:, 0].tolist()


def case(name, make_a, change, make_b):
    a = make_a()
    batch(a)  # fills the cache
    change()
    b = make_b()
    got = batch(b)
    src, rd, dc = b._stages.source, b._stages.read, b._stages.decode
    truth = []
    for i in range(N):
        x = src[i]
        if rd is not None: x = rd(x)
        if dc is not None: x = dc(x)
        truth.append(int(np.asarray(x).reshape(-1)[0]))
    same = a.cache_key() == b.cache_key()
    print(f"{name:34s} keys equal: {same!s:5s} B from cache: {got}  B truth: {truth}  {'WRONG' if got != truth else 'ok'}")
    a.close(); b.close()


def P(src, **kw):
    return tsock.Pipeline(src, batch_size=N, shuffle=False, cache_bytes=1 << 22, **kw)


# 1. a class attribute (a constant the class's code reads through self)
class Scaled:
    SCALE = 10
    def __len__(self): return N
    def __getitem__(self, i): return np.full(2, i * self.SCALE, dtype=np.int64)

case("class attribute SCALE 10 -> 100", lambda: P(Scaled()), lambda: setattr(Scaled, "SCALE", 100), lambda: P(Scaled()))


# 2. an inherited method: the base class's __getitem__ (edited, here rebound)
class Base:
    def __len__(self): return N
    def __getitem__(self, i): return np.full(2, i * 10, dtype=np.int64)

class Child(Base):
    pass

def _new_getitem(self, i): return np.full(2, i * 100, dtype=np.int64)
case("base class __getitem__ edited", lambda: P(Child()), lambda: setattr(Base, "__getitem__", _new_getitem), lambda: P(Child()))


# 3. a helper reached as module.attribute (a user module edited between runs)
d = tempfile.mkdtemp()
sys.path.insert(0, d)
with open(os.path.join(d, "r33helpers.py"), "w") as f:
    f.write("import numpy as np\ndef scale(x):\n    return np.int64(x) * 10\n")
import r33helpers

def decode_via_module(x):
    return r33helpers.scale(x)

def edit_module():
    with open(os.path.join(d, "r33helpers.py"), "w") as f:
        f.write("import numpy as np\ndef scale(x):\n    return np.int64(x) * 100\n")
    os.utime(os.path.join(d, "r33helpers.py"), (1, 1e9 + 5))
    importlib.invalidate_caches(); importlib.reload(r33helpers)

case("helper as module.attr edited", lambda: P(list(range(N)), decode=decode_via_module), edit_module,
     lambda: P(list(range(N)), decode=decode_via_module))


# 4. a decode wrapped by functools.lru_cache (the same name, another body)
@functools.lru_cache(maxsize=None)
def cached_decode(x): return np.int64(x) * 10
first = cached_decode
def redefine():
    global cached_decode
    @functools.lru_cache(maxsize=None)
    def cached_decode(x): return np.int64(x) * 100
    globals()["cached_decode"] = cached_decode
case("lru_cache decode redefined", lambda: P(list(range(N)), decode=first), redefine,
     lambda: P(list(range(N)), decode=cached_decode))


# 5. a transform held as a class attribute (a common dataset pattern)
class T:
    def __init__(self, k): self.k = k
    def __call__(self, x): return x * self.k

class WithTransform:
    transform = T(10)
    def __len__(self): return N
    def __getitem__(self, i): return self.transform(np.full(2, i, dtype=np.int64))

case("class-level transform T(10)->T(100)", lambda: P(WithTransform()),
     lambda: setattr(WithTransform, "transform", T(100)), lambda: P(WithTransform()))


# 6. a global reached three calls deep (documented as a limit, for scale)
K3 = [10]
def h3(x): return x * K3[0]
def h2(x): return h3(x)
def h1(x): return h2(x)
def dec3(x): return h1(np.int64(x))
case("global three calls deep", lambda: P(list(range(N)), decode=dec3), lambda: K3.__setitem__(0, 100),
     lambda: P(list(range(N)), decode=dec3))
