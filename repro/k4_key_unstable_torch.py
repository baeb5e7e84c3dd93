"""Review 33, K4: a source (or a transform) holding a torch tensor gets a new
cache key for every object and in every process: a tensor pickles its
storage through torch.save, whose zip archive carries a fresh
.data/serialization_id. Two trainers of one dataset (each builds its own
Pipeline) never share the cache; a kept cache is never found again."""
import subprocess, sys
CODE = r'''
import numpy as np, torch, tsock
class DS:
    def __init__(self): self.mean = torch.tensor([0.485, 0.456, 0.406])
    def __len__(self): return 6
    def __getitem__(self, i): return np.float32(i) - self.mean.numpy()[0]
a = tsock.Pipeline(DS(), batch_size=6, cache_bytes=1 << 22)
b = tsock.Pipeline(DS(), batch_size=6, cache_bytes=1 << 22)
print(a.cache_key().hex(), b.cache_key().hex())
'''
for run in range(3):
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True).stdout.split()
    print(f"process {run}: trainer A key {out[0][:16]}  trainer B key {out[1][:16]}  equal: {out[0] == out[1]}")
