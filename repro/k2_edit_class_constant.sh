# Review 33, K1 across runs: the user edits a class constant of the dataset
# (SCALE = 10 -> 100) and reruns a job that keeps its cache (cache_keep=True).
for K in 10 100; do
cat > /tmp/review33-job.py <<PY
import numpy as np, tsock
class DS:
    SCALE = $K
    def __len__(self): return 6
    def __getitem__(self, i): return np.int64(i * self.SCALE)
p = tsock.Pipeline(DS(), batch_size=6, shuffle=False, cache_bytes=1 << 22, cache_keep=True)
print("run with SCALE = $K:", np.asarray(next(iter(p))).tolist(), "key", p.cache_key().hex()[:12]); p.close()
PY
$PY /tmp/review33-job.py
done
# remove only this job's segment (tsock.remove_caches() would remove every unused cache of the uid)
sed -i 's/cache_keep=True)/cache_keep=False)/' /tmp/review33-job.py && $PY /tmp/review33-job.py >/dev/null; rm -f /tmp/review33-job.py
