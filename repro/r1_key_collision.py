"""Two datasets of one class and length, different contents: same cache key,
the second pipeline is served the first one's decoded samples."""
import numpy as np, functools, warnings, tsock

class Folder:
    def __init__(self, root): self.root = root
    def __len__(self): return 8
    def __getitem__(self, i): return np.full(4, hash(self.root) % 1000 + i, dtype=np.int64)

def decode(x): return x

def make_scale(k):
    def scale(x): return x * k
    return scale

def run(src, dec):
    p = tsock.Pipeline(src, decode=dec, batch_size=8, shuffle=False, cache_bytes=1 << 22)
    b = next(iter(p)); p.close(); return p, np.asarray(b)

a_p, a = run(Folder("/data/train"), decode)
b_p, b = run(Folder("/data/val"), decode)
print("train key", a_p.cache_key().hex(), "val key", b_p.cache_key().hex())
print("val batch with cache  :", b[:3, 0].tolist())
print("val batch truth       :", [Folder("/data/val")[i][0] for i in range(3)])
c_p, c = run(Folder("/data/x"), make_scale(2))
d_p, d = run(Folder("/data/x"), make_scale(3))
print("closure keys equal:", c_p.cache_key() == d_p.cache_key(), "scale3 batch:", d[:2, 0].tolist(),
      "truth:", [Folder("/data/x")[i][0] * 3 for i in range(2)])
for p in (a_p, b_p, c_p, d_p): p.remove_cache()
