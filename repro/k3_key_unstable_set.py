"""Review 33, K3: a dataset holding a set (of class names, extensions) gets
another cache key in every process (pickle writes a set in string-hash
order, which PYTHONHASHSEED randomises): two trainers of one dataset never
share the cache, and a kept cache is never found warm by the next run."""
import os, subprocess, sys
CODE = r'''
import numpy as np, tsock
class DS:
    def __init__(self): self.exts = {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".webp"}
    def __len__(self): return 6
    def __getitem__(self, i): return np.int64(i)
p = tsock.Pipeline(DS(), batch_size=6, cache_bytes=1 << 22)
print(p.cache_key().hex())
'''
keys = set()
for run in range(6):
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=dict(os.environ)).stdout.strip()
    keys.add(out)
    print("process", run, "key", out)
print(len(keys), "distinct keys in 6 processes of the same program")
