# review 33: rerun of review 31 r1b with cache_keep=True (the segment is removed at close by default now)
# run 1: decode multiplies by 10; run 2 (the user fixed decode to multiply by 100): same key, stale samples
for K in 10 100; do
cat > /tmp/review33-job.py <<PY
import numpy as np, tsock
def decode(x): return x * $K
p = tsock.Pipeline(list(range(6)), read=np.int64, decode=decode, batch_size=6, shuffle=False, cache_bytes=1 << 22, cache_keep=True)
print("run with decode*$K:", np.asarray(next(iter(p))).tolist()); p.close()
PY
$PY /tmp/review33-job.py
done
cat > /tmp/review33-job.py <<'PY'
import numpy as np, tsock
def decode(x): return x
p = tsock.Pipeline(list(range(6)), read=np.int64, decode=decode, batch_size=6, shuffle=False, cache_bytes=1 << 22, cache_keep=True)
p.remove_cache()
PY
$PY /tmp/review33-job.py; rm -f /tmp/review33-job.py
