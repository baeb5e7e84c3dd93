"""Review 33, W1: review 31 F4(a)'s fix reads a sample block by block with
pread after checking its chain; a same-uid peer that truncates and
re-extends the file between two of those preads leaves the later blocks
zero while the first (the codec's description of the sample) is intact:
decode accepts it, and the pipeline gets an array whose tail is zeros.
The store test (test_a_lookup_survives_a_peer_truncating_the_segment_under_it)
uses one-block samples and so only ever sees a whole buffer zeroed."""
import os, sys, tempfile, time, multiprocessing as mp
import numpy as np
from tsock._cache_codec import decode, encode, CorruptSample
from tsock._cache_store import CacheStore
from tsock.errors import CacheError
FORK = mp.get_context("fork")
N = 8
def sample(i): return np.full(12_000, i + 1, dtype=np.int32)  # 48 KB: 3 blocks of 16 KiB
def reader(d, secs, q):
    s = CacheStore(b"w" * 16, N, budget=4 << 20, directory=d)
    out = dict(hit=0, miss=0, error=0, refused=0, wrong=0)
    t = time.monotonic()
    while time.monotonic() - t < secs:
        for i in range(N):
            try:
                raw = s.get(i)
            except CacheError:
                out["error"] += 1; continue
            if raw is None:
                out["miss"] += 1; continue
            try:
                x = decode(raw)
            except CorruptSample:
                out["refused"] += 1; continue
            if np.array_equal(x, sample(i)): out["hit"] += 1
            else:
                out["wrong"] += 1
                if out["wrong"] == 1: print("decoded without complaint:", i, "zeros in it:", int((x == 0).sum()), "of", x.size, flush=True)
    q.put(out)
def truncator(path, size, stop):
    fd = os.open(path, os.O_RDWR)
    import random
    while not stop.is_set():  # zero the file now and then (a buggy or hostile peer of the same uid)
        os.ftruncate(fd, 4096); os.ftruncate(fd, size)
        time.sleep(random.uniform(0, 0.002))
if __name__ == "__main__":
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="r33w-")
    wrong = 0
    for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
        s = CacheStore(b"w" * 16, N, budget=4 << 20, directory=d)
        for i in range(N): s.put(i, encode(sample(i)))
        size = os.path.getsize(s.path)
        q, stop = FORK.Queue(), FORK.Event()
        r = FORK.Process(target=reader, args=(d, 3, q)); r.start()
        t = FORK.Process(target=truncator, args=(s.path, size, stop)); t.start()
        r.join(); stop.set(); t.join()
        out = q.get(); print("round", rnd, out, "reader exit", r.exitcode, flush=True)
        wrong += out["wrong"]
        s.close(); os.unlink(s.path)
    os.rmdir(d)
    print("samples decoded with zeroed blocks:", wrong)
