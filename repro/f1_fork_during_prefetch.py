"""Review 33, F1 check: forks while background order threads compute (the
child computes the same order itself); 40 forks, each child must finish
within 60 s."""
import os, sys, time, signal
from tsock._cache_orders import ORDERS
from tsock._sampler import sample_sequence
n = 1_000_000
def params(ws): return {"n": n, "seed": 1, "shuffle": True, "batch_size": 32, "drop_last": False, "world_size": ws,
                        "ranks": [0, 1] if ws else [0], "sampler_drop_last": False}
hung = 0
for k in range(40):
    p = params(2 if k % 2 else 0)
    ORDERS.prefetch(b"b%d" % k, k, lambda e, p=p: sample_sequence(p, e), n)
    time.sleep(0.01 * (k % 7))
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)
        inv, L = ORDERS.get(b"b%d" % k, k, lambda e, p=p: sample_sequence(p, e), n)
        os._exit(0 if L > 0 else 1)
    _, st = os.waitpid(pid, 0)
    if st != 0:
        hung += 1; print("child", k, "status", st)
print("forks:", 40, "children that failed or hung:", hung)
