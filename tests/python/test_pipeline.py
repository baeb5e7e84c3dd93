"""tsock.Pipeline on its own: the order is a pure function of (seed, epoch),
batches are the same bytes whatever the worker count, seeking computes
nothing before the start, partition mode equals DistributedSampler, and
failing stages or workers give clear errors, never a hang or a leftover
process."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pipeline_helpers as h
import pytest
import torch  # imported before any pipeline is made: noisy_torch uses its global generator
import tsock
from conftest import child_env
from tsock import _sampler

# ---- the order --------------------------------------------------------------------------------------------

MASK = (1 << 64) - 1


def _documented_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order as docs/PIPELINE.md defines it, with Python ints only."""

    def mix(z):
        z &= MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    golden = 0x9E3779B97F4A7C15
    key = mix(mix(seed ^ golden) ^ epoch)
    return sorted(range(n), key=lambda i: (mix((i * golden + key) & MASK), i))


@pytest.mark.parametrize("n,seed,epoch", [(1, 0, 0), (10, 0, 0), (10, 0, 1), (257, 5, 3), (1000, (1 << 63) - 1, 7)])
def test_order_is_the_documented_function(n, seed, epoch):
    assert _sampler.epoch_order(n, seed, epoch, True).tolist() == _documented_order(n, seed, epoch)


def test_order_properties():
    a = _sampler.epoch_order(500, 3, 0, True)
    assert sorted(a.tolist()) == list(range(500))
    assert a.dtype == np.int64
    assert a.tolist() != _sampler.epoch_order(500, 3, 1, True).tolist()  # epochs differ
    assert a.tolist() != _sampler.epoch_order(500, 4, 0, True).tolist()  # seeds differ
    assert _sampler.epoch_order(7, 3, 0, False).tolist() == list(range(7))


def test_order_and_fingerprint_are_the_same_in_another_process():
    code = """
        import sys
        import pipeline_helpers as h
        p = h.make_pipeline()
        print(p.fingerprint.hex(), ",".join(map(str, p.indices(2).tolist())))
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    fp, order = out.stdout.split()
    p = h.make_pipeline()
    assert fp == p.fingerprint.hex()
    assert order == ",".join(map(str, p.indices(2).tolist()))


# ---- determinism and seeking ------------------------------------------------------------------------------


def _hashes(pipe, epoch, start=0):
    return [h.batch_hash(b) for b in pipe.batches(epoch, start)]


def test_batches_are_identical_whatever_the_worker_count():
    one = h.make_pipeline(workers=0, n=101, batch_size=8, augment=h.noisy_torch)
    ref = [_hashes(one, e) for e in range(2)]
    assert len(ref[0]) == 13 and ref[0] != ref[1]
    for workers in (1, 4):
        with h.make_pipeline(workers=workers, n=101, batch_size=8, augment=h.noisy_torch) as p:
            assert [_hashes(p, e) for e in range(2)] == ref, f"{workers} workers"


def test_global_generators_are_seeded_per_sample():
    # noisy_torch draws from random, numpy's and torch's global generators
    # too: their values are part of the hash, so they must repeat as well.
    one = h.make_pipeline(workers=0, augment=h.noisy_torch)
    with h.make_pipeline(workers=2, augment=h.noisy_torch) as two:
        assert _hashes(one, 0) == _hashes(two, 0)
    # A different seed gives different numbers (the generators are not fixed).
    assert _hashes(one, 0) != _hashes(h.make_pipeline(seed=12, augment=h.noisy_torch), 0)


def test_in_process_stages_leave_the_callers_generators_alone():

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    list(h.make_pipeline(workers=0, augment=h.noisy_torch).batches(0))  # seeds them per sample, then puts them back
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want


@pytest.mark.parametrize("workers", [0, 2])
def test_seek_gives_the_tail_of_the_epoch(workers):
    with h.make_pipeline(workers=workers, n=50, batch_size=4) as p:
        full = _hashes(p, 3)
        assert len(full) == len(p) == 13
        for k in (0, 1, 7, 12, 13):
            assert _hashes(p, 3, start=k) == full[k:], f"start={k}"
        with pytest.raises(ValueError):
            p.batches(3, start=14)


def test_seek_computes_nothing_before_the_start():
    src = h.Counting(50)
    p = tsock.Pipeline(src, batch_size=4, seed=2)
    list(p.batches(1, start=10))
    assert sorted(src.loaded) == sorted(p.indices(1)[40:].tolist())


def test_batch_info_names_the_samples():
    p = tsock.Pipeline(h.Numbers(30), batch_size=8, seed=5, drop_last=False)
    infos = []
    for info, (_, y) in p.batches(2, with_info=True):
        assert y.tolist() == info.indices.tolist()
        assert info == p.info(2, info.index)
        infos.append(info)
    assert [i.index for i in infos] == [0, 1, 2, 3] and [len(i) for i in infos] == [8, 8, 8, 6]
    assert np.concatenate([i.indices for i in infos]).tolist() == p.indices(2).tolist()
    assert [(i.start, i.stop) for i in infos] == [(0, 8), (8, 16), (16, 24), (24, 30)]
    dropped = tsock.Pipeline(h.Numbers(30), batch_size=8, drop_last=True)
    assert len(dropped) == 3 and dropped.samples_per_epoch == 24 and len(list(dropped.batches(0))) == 3
    with pytest.raises(IndexError):
        p.info(0, 4)


def test_for_loops_go_through_the_epochs():
    p = h.make_pipeline()
    want = [_hashes(p, e) for e in range(3)]
    assert [[h.batch_hash(b) for b in p] for _ in range(2)] == want[:2]
    p.set_epoch(2)
    assert [h.batch_hash(b) for b in p] == want[2] and p.epoch == 3


def test_shuffle_false_keeps_the_source_order():
    p = tsock.Pipeline(h.Numbers(10), batch_size=4, shuffle=False)
    assert [y.tolist() for _, y in p.batches(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_files_with_a_read_function(tmp_path):
    names = []
    for i in range(6):
        path = tmp_path / f"{i}.bin"
        path.write_bytes(bytes([i]) * 4)
        names.append(str(path))
    p = tsock.Pipeline(names, batch_size=3, read=_read_file, decode=_decode, shuffle=False)
    assert [b.tolist() for b in p.batches(0)] == [[[0] * 4, [1] * 4, [2] * 4], [[3] * 4, [4] * 4, [5] * 4]]
    # The file names are part of the fingerprint: other files, another pipeline.
    other = tsock.Pipeline(names[::-1], batch_size=3, read=_read_file, decode=_decode, shuffle=False)
    assert other.fingerprint != p.fingerprint


def _read_file(path):
    with open(path, "rb") as f:
        return f.read()


def _decode(data):
    return np.frombuffer(data, np.uint8)


def test_spawn_workers():
    # Spawned workers import torch as the parent has (so that its generator
    # is seeded there too), and the stages by name.
    ref = _hashes(h.make_pipeline(workers=0, augment=h.noisy_torch), 1)
    with h.make_pipeline(workers=2, start_method="spawn", augment=h.noisy_torch) as p:
        assert _hashes(p, 1) == ref


def test_torch_tensor_samples_stay_tensors():

    src = [(torch.full((2,), float(i)), torch.tensor(i, dtype=torch.bfloat16)) for i in range(9)]
    ref = list(tsock.Pipeline(src, batch_size=4, seed=1).batches(0))
    with tsock.Pipeline(src, batch_size=4, seed=1, workers=2) as p:
        got = list(p.batches(0))
    assert len(got) == 3
    for (a, b), (c, d) in zip(ref, got):
        assert isinstance(c, torch.Tensor) and d.dtype == torch.bfloat16
        assert torch.equal(a, c) and torch.equal(b, d)


# ---- the fingerprint --------------------------------------------------------------------------------------


def test_fingerprint():
    base = h.make_pipeline()
    assert len(base.fingerprint) == 16
    assert h.make_pipeline().fingerprint == base.fingerprint
    same = [
        h.make_pipeline(workers=3),
        h.make_pipeline(prefetch=5),
        h.make_pipeline(timeout=3.0),
        h.make_pipeline(start_method="spawn"),
    ]
    for p in same:
        assert p.fingerprint == base.fingerprint, p
        p.close()
    different = [
        h.make_pipeline(seed=12),
        h.make_pipeline(batch_size=5),
        h.make_pipeline(n=61),
        h.make_pipeline(shuffle=False),
        h.make_pipeline(drop_last=True),
        h.make_pipeline(augment=h.fail_on_13),
        h.make_pipeline(version="v2"),
        h.make_pipeline(world_size=2),
        h.make_pipeline(decode=_decode),
    ]
    prints = {p.fingerprint for p in different}
    assert len(prints) == len(different) and base.fingerprint not in prints


# ---- partition mode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 10, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_partition_equals_distributed_sampler(n, world, drop_last):
    from torch.utils.data import DistributedSampler

    for seed, epoch, shuffle in ((0, 0, True), (7, 3, True), (1, 1, False)):
        p = tsock.Pipeline(
            range(n), batch_size=2, seed=seed, shuffle=shuffle, world_size=world, sampler_drop_last=drop_last
        )
        for rank in range(world):
            ds = DistributedSampler(
                range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
            )
            ds.set_epoch(epoch)
            assert p.indices(epoch, rank=rank).tolist() == list(ds), (seed, epoch, shuffle, rank)


def test_partition_batches_interleave_the_ranks():
    p = tsock.Pipeline(h.Numbers(23), batch_size=3, seed=4, world_size=3)
    assert p.steps == 3 and len(p) == 9  # 8 samples per rank (23 padded to 24): batches of 3, 3, 2
    per_rank = collections.defaultdict(list)
    for info, (_, y) in p.batches(1, with_info=True):
        assert info.rank == info.index % 3 and info.step == info.index // 3 and info.world_size == 3
        assert y.tolist() == info.indices.tolist()
        per_rank[info.rank] += y.tolist()
    for r in range(3):
        assert per_rank[r] == p.indices(1, rank=r).tolist()
    # A node making ranks 1 and 2 of the same job: their batches, the same bytes.
    node = tsock.Pipeline(h.Numbers(23), batch_size=3, seed=4, world_size=3, ranks=(1, 2))
    assert len(node) == 6 and node.fingerprint == p.fingerprint
    whole = {(i.rank, i.step): h.batch_hash(b) for i, b in p.batches(1, with_info=True)}
    for info, b in node.batches(1, with_info=True):
        assert info.rank in (1, 2) and whole[(info.rank, info.step)] == h.batch_hash(b)


def test_partition_arguments():
    with pytest.raises(ValueError):
        tsock.Pipeline(range(5), batch_size=2, ranks=(0,))
    with pytest.raises(ValueError):
        tsock.Pipeline(range(5), batch_size=2, world_size=2, ranks=(0, 0))
    with pytest.raises(ValueError):
        tsock.Pipeline(range(5), batch_size=2, world_size=2, ranks=(2,))
    p = tsock.Pipeline(range(5), batch_size=2, world_size=2)
    with pytest.raises(ValueError, match="rank="):
        p.indices(0)


# ---- failures ---------------------------------------------------------------------------------------------


def test_stage_error_in_process():
    p = h.make_pipeline(augment=h.fail_on_13, shuffle=False)
    with pytest.raises(tsock.PipelineError, match=r"augment failed on sample 13 of epoch 0 \(batch 3 of epoch 0\)"):
        list(p.batches(0))
    try:
        list(p.batches(0, start=3))
    except tsock.PipelineError as e:
        assert isinstance(e.__cause__, ValueError) and "sample 13 is bad" in str(e)


def test_stage_error_in_a_worker_has_its_traceback_and_the_pool_goes_on():
    with h.make_pipeline(workers=2, augment=h.fail_on_13, shuffle=False) as p:
        t0 = time.monotonic()
        with pytest.raises(tsock.PipelineError) as err:
            list(p.batches(0))
        assert time.monotonic() - t0 < 30
        text = str(err.value)
        assert "augment failed on sample 13 of epoch 0" in text and "ValueError: sample 13 is bad" in text
        assert "worker traceback" in text and "fail_on_13" in text  # the worker's own traceback
        pids = [w.pid for w in p._pool_box[0].procs]
        assert len(list(p.batches(0, start=4))) == len(p) - 4  # the same workers, still working
        assert [w.pid for w in p._pool_box[0].procs] == pids


@pytest.mark.parametrize("workers", [0, 1])
def test_collate_error_names_the_difference(workers):
    want = r"collate failed on epoch 0 \(batch 0 of epoch 0\).*sample\[0\]: sample 0 has shape \(3, 4\)"
    with tsock.Pipeline(h.Ragged(8), batch_size=8, shuffle=False, workers=workers) as p:
        with pytest.raises(tsock.PipelineError, match=want):
            list(p.batches(0))


def test_killed_worker_is_reported_and_nothing_is_left():
    with h.make_pipeline(workers=3, augment=h.die_on_13, shuffle=False) as p:
        p.start()
        pids = [w.pid for w in p._pool_box[0].procs]
        with pytest.raises(tsock.WorkerDied, match=r"killed by SIGKILL while computing batch 3 of epoch 0"):
            list(p.batches(0))
        assert h.wait_gone(pids) == [], "every worker stopped"
        # The next iteration starts new workers.
        assert len(list(p.batches(0, start=4))) == len(p) - 4
        assert not set(w.pid for w in p._pool_box[0].procs) & set(pids)


def test_worker_killed_between_epochs():
    with h.make_pipeline(workers=2) as p:
        list(p.batches(0))
        os.kill(p._pool_box[0].procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(tsock.WorkerDied, match="worker 1"):
            list(p.batches(1))
        assert time.monotonic() - t0 < 30


def test_timeout_stops_a_stuck_worker():
    # The timeout bounds every wait for a batch: 5 s, not 1, so that a worker
    # held off its CPU on a loaded machine does not time out batches 0-2
    # (sample 13's stage sleeps 30 s: only batch 3 is stuck).
    with h.make_pipeline(workers=2, augment=h.slow_on_13, shuffle=False, timeout=5.0) as p:
        p.start()
        pids = [w.pid for w in p._pool_box[0].procs]
        t0 = time.monotonic()
        with pytest.raises(tsock.PipelineError, match=r"within timeout=5 s \(waiting for batch 3 of epoch 0"):
            list(p.batches(0))
        assert time.monotonic() - t0 < 20
        assert h.wait_gone(pids) == []


def test_one_iteration_at_a_time():
    with h.make_pipeline(workers=2) as p:
        first = p.batches(0)
        next(first)
        assert len(list(p.batches(1))) == len(p)  # the second one works...
        with pytest.raises(tsock.PipelineError, match="one iteration at a time"):
            next(first)  # ...and the first says why it cannot go on, instead of waiting for ever
        assert len(list(p.batches(0))) == len(p)


def test_close_stops_the_workers():
    p = h.make_pipeline(workers=2)
    list(p.batches(0))
    pids = [w.pid for w in p._pool_box[0].procs]
    p.close()
    assert h.wait_gone(pids) == []


def test_workers_exit_when_the_parent_is_killed(spawn):
    code = """
        import time
        import pipeline_helpers as h
        p = h.make_pipeline(workers=2)
        next(p.batches(0))
        print("workers", *[w.pid for w in p._pool_box[0].procs], flush=True)
        time.sleep(60)
    """
    proc = spawn(code)
    line = proc.stdout.readline().split()
    assert line and line[0] == "workers", proc.stderr.read() if proc.poll() is not None else line
    pids = [int(x) for x in line[1:]]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert h.wait_gone(pids) == [], "workers outlived their killed parent"


def test_bad_arguments():
    with pytest.raises(TypeError, match="map-style"):
        tsock.Pipeline(iter(range(3)), batch_size=1)
    with pytest.raises(ValueError):
        tsock.Pipeline(range(3), batch_size=0)
    with pytest.raises(ValueError):
        tsock.Pipeline(range(3), batch_size=1, seed=-1)
    with pytest.raises(TypeError):
        tsock.Pipeline(range(3), batch_size=1, augment="flip")
    with pytest.raises(ValueError):
        tsock.Pipeline(range(3), batch_size=1, workers=1, start_method="thread")
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(tsock.Pipeline(range(3), batch_size=1))


# ---- default_collate ----------------------------------------------------------------------------------------

Point = collections.namedtuple("Point", "x y")


def test_default_collate_matches_torch():
    from torch.utils.data import default_collate as torch_collate

    samples = [
        {
            "img": np.full((2, 3), i, np.float32),
            "t": torch.full((2,), float(i)),
            "label": i,
            "w": float(i) / 2,
            "ok": i % 2 == 0,
            "name": f"s{i}",
            "pair": (np.int16(i), [i, -i]),
            "pt": Point(i, 2 * i),
        }
        for i in range(4)
    ]
    ours, theirs = tsock.default_collate(samples), torch_collate(samples)
    assert ours.keys() == theirs.keys()

    def same(a, b):
        if isinstance(b, torch.Tensor):
            a = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a))
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(b, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b

    for k in theirs:
        same(ours[k], theirs[k])
    assert isinstance(ours["img"], np.ndarray) and isinstance(ours["t"], torch.Tensor)
    assert isinstance(ours["pair"], tuple) and isinstance(ours["pair"][1], list)  # torch: both lists
    assert isinstance(ours["pt"], Point)


@pytest.mark.parametrize(
    "view",
    [
        lambda b: b[:, ::-1],  # a horizontal flip: the pixel-item path
        lambda b: b[::-1, ::-1],
        lambda b: b[:, ::-1, ::-1],  # channels reversed too: not a pixel's contiguous bytes
        lambda b: b[:, ::-2],
        lambda b: b.astype(np.float32)[:, ::-1],
        lambda b: b[:, ::-1, :2],
        lambda b: b.transpose(1, 0, 2),
    ],
)
def test_default_collate_copies_flipped_images_exactly(view):
    from tsock._collate import _pixel_size, _walks_pixels_back

    def _pixel_bytes(x):  # the pixel-item path's test of one sample
        n = _pixel_size(x)
        return n if n and _walks_pixels_back(x, n) else 0

    rng = np.random.default_rng(3)
    base = [rng.integers(0, 256, (40, 41, 3), dtype=np.uint8) for _ in range(4)]  # above SAMPLE_MIN
    samples = [view(b) for b in base]
    samples[2] = np.ascontiguousarray(samples[2])  # a batch may mix layouts
    for batch in (samples, samples[2:] + samples[:2]):  # a first sample flipped, or not
        ours, want = tsock.default_collate(batch), np.stack(batch)
        assert ours.dtype == want.dtype and ours.shape == want.shape
        np.testing.assert_array_equal(ours, want)
        if any(_pixel_bytes(s) for s in batch):
            assert ours.flags.c_contiguous
    assert _pixel_bytes(base[0][:, ::-1]) == 3 and _pixel_bytes(base[0]) == 0


@pytest.mark.parametrize("dtype", [">f4", ">i2", "<f2", "c8", "?", [("a", "u1"), ("b", ">u2")]])
def test_default_collate_of_flipped_samples_keeps_np_stacks_dtype(dtype):
    """The batch's dtype is np.stack's whatever the first sample's layout
    (review 44: a big-endian flipped first sample gave a big-endian batch,
    native otherwise)."""
    rng = np.random.default_rng(4)
    base = [rng.integers(0, 2, (40, 50, 2)).astype(dtype) for _ in range(3)]
    for samples in ([b[:, ::-1] for b in base], base):
        ours, want = tsock.default_collate(samples), np.stack(samples)
        assert ours.dtype == want.dtype and ours.shape == want.shape
        np.testing.assert_array_equal(ours, want)


def test_default_collate_errors():
    with pytest.raises(ValueError, match=r"sample\['a'\]: sample 0 has shape \(2,\)"):
        tsock.default_collate([{"a": np.zeros(2)}, {"a": np.zeros(3)}])
    with pytest.raises(ValueError, match="keys"):
        tsock.default_collate([{"a": 1}, {"b": 1}])
    with pytest.raises(ValueError, match=r"sample: sample 0 is a tuple of 2"):
        tsock.default_collate([(1, 2), (1, 2, 3)])
    with pytest.raises(TypeError, match="cannot batch sample of type object"):
        tsock.default_collate([object()])
    with pytest.raises(ValueError):
        tsock.default_collate([])
