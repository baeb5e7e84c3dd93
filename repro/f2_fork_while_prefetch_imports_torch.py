"""Review 33, F2: a process forks (a workers=N pool with the default fork
start) while the cache's background order thread (ORDERS.prefetch, started
by a Belady eviction at 90% of a consumer's epoch) computes a partition-mode
order, whose first use imports torch (_sampler: torch.randperm). The child
that then needs that order itself (every forked worker that evicts) waits
forever: the import of torch in the child waits on the module lock the
parent's thread held at the fork. Python warns of exactly this
(DeprecationWarning: multi-threaded fork). Prints the child's stack after
20 s."""
import faulthandler, os, sys, time, signal, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from tsock._cache_orders import ORDERS
from tsock._sampler import sample_sequence
n = 1_000_000
p = {"n": n, "seed": 1, "shuffle": True, "batch_size": 32, "drop_last": False, "world_size": 2, "ranks": [0, 1],
     "sampler_drop_last": False}
fn = lambda e: sample_sequence(p, e)
print("torch imported before:", "torch" in sys.modules, flush=True)
ORDERS.prefetch(b"blob", 3, fn, n)       # what _futures does at 90% of an epoch
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0.01)
pid = os.fork()                            # what the worker pool does
if pid == 0:
    faulthandler.dump_traceback_later(20, exit=True)
    t = time.time()
    ORDERS.get(b"blob", 3, fn, n)          # the child's first eviction needs the same order
    print(f"child got the order in {time.time() - t:.1f} s", flush=True)
    os._exit(0)
_, st = os.waitpid(pid, 0)
print("child exit status", st >> 8, "(1: killed by the 20 s watchdog: it hung)")
