"""Per-consumer batch sizes: every sample exactly once per epoch, in order,
whether the sizes divide or not; drop_last as in DataLoader; len() agrees."""

import math

import numpy as np
import pytest
import torch
import tsock
from torch.utils.data import DataLoader, TensorDataset

SAMPLES = 50


def _ids(batch, output):
    ids = batch["id"]
    if output == "jax":
        ids = np.asarray(ids)
    elif output == "torch":
        ids = ids.numpy()
    feats = batch["x"]
    feats = np.asarray(feats.numpy() if output == "torch" else feats)
    # Every leaf was cut at the same rows: features carry the id too.
    np.testing.assert_array_equal(feats[:, 0], ids * 10)
    return ids.tolist()


def loader():
    ids = torch.arange(SAMPLES, dtype=torch.int32)
    x = torch.stack([ids * 10, ids * 10 + 1], dim=1).float()
    ds = TensorDataset(ids, x)
    return DataLoader(
        ds,
        batch_size=7,
        collate_fn=lambda rows: {"id": torch.stack([r[0] for r in rows]), "x": torch.stack([r[1] for r in rows])},
    )


CASES = [(b, d) for b in (1, 3, 5, 7, 10, 25, 50, 64) for d in (False, True)]


def test_every_sample_exactly_once_for_every_size(channel, run_producer):
    epochs = 2
    run_producer(tsock.Producer(loader(), channel, slots=64, wait_readers=len(CASES)), epochs=epochs)
    consumers = [tsock.Consumer(channel, batch_size=b, drop_last=d, timeout=10) for b, d in CASES]
    try:
        for (size, drop_last), c in zip(CASES, consumers):
            want_len = SAMPLES // size if drop_last else math.ceil(SAMPLES / size)
            assert len(c) == want_len, (size, drop_last)
            for epoch in range(epochs):
                sizes, seen = [], []
                for batch in c:
                    ids = _ids(batch, "numpy")
                    sizes.append(len(ids))
                    seen.extend(ids)
                kept = want_len * size if drop_last else SAMPLES
                assert seen == list(range(kept)), (size, drop_last, epoch)
                assert len(sizes) == want_len
                assert all(s == size for s in sizes[:-1])
                if sizes:  # 64 with drop_last: no batch at all
                    assert sizes[-1] == (size if drop_last or SAMPLES % size == 0 else SAMPLES % size)
                assert c.epoch == epoch + 1
    finally:
        for c in consumers:
            c.close()


@pytest.mark.parametrize("output", ["torch", "jax"])
def test_rebatching_other_outputs(channel, run_producer, output):
    run_producer(tsock.Producer(loader(), channel, slots=16, wait_readers=1))
    with tsock.Consumer(channel, batch_size=4, output=output, timeout=10) as c:
        seen = []
        for batch in c:
            seen.extend(_ids(batch, output))
        assert seen == list(range(SAMPLES))


@pytest.mark.parametrize("output", ["numpy", "torch", "jax"])
def test_straddling_batches_keep_every_dtype(channel, run_producer, output):
    import ml_dtypes

    rows = np.arange(12)
    batches = [
        (
            (rows[a : a + 4] % 2 == 0),
            rows[a : a + 4].astype(ml_dtypes.bfloat16),
            rows[a : a + 4].astype(np.float16),
            rows[a : a + 4].astype(np.int8),
        )
        for a in (0, 4, 8)
    ]
    run_producer(tsock.Producer(batches, channel, slots=8, wait_readers=1))
    with tsock.Consumer(channel, batch_size=3, output=output, timeout=10) as c:
        got = []
        for batch in c:  # [0:3] inside, [3:6] straddles, ...
            leaves = []
            for x in batch:
                if output == "torch":
                    x = x.float().numpy() if x.dtype == torch.bfloat16 else x.numpy()
                leaves.append(np.asarray(x).astype(np.float64))
            got.append(np.stack(leaves, 1))
        got = np.concatenate(got)
    want = np.stack([rows % 2 == 0, rows, rows, rows], 1).astype(np.float64)
    np.testing.assert_array_equal(got, want)


def test_uneven_producer_batches(channel, run_producer):
    sizes = [5, 1, 9, 3, 0, 12, 2]
    start = np.cumsum([0] + sizes)
    batches = [
        {"id": np.arange(a, a + n, dtype=np.int64), "x": np.stack([np.arange(a, a + n) * 10] * 2, 1).astype(np.float32)}
        for a, n in zip(start, sizes)
    ]
    run_producer(tsock.Producer(batches, channel, slots=16, wait_readers=2, slot_bytes=4096))
    with (
        tsock.Consumer(channel, batch_size=4, timeout=10) as c,
        tsock.Consumer(channel, batch_size=4, drop_last=True, timeout=10) as d,
    ):
        total = sum(sizes)
        assert len(c) == math.ceil(total / 4) and len(d) == total // 4
        assert sum((_ids(b, "numpy") for b in c), []) == list(range(total))
        assert sum((_ids(b, "numpy") for b in d), []) == list(range(total // 4 * 4))


def test_rebatching_needs_a_shared_first_dimension(channel, run_producer):
    run_producer(tsock.Producer([(np.zeros((4, 2)), np.zeros(3))], channel, wait_readers=1))
    with tsock.Consumer(channel, batch_size=2, timeout=10) as c:
        with pytest.raises(ValueError, match="first dimension"):
            next(iter(c))


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True])
def test_bad_batch_sizes(channel, bad):
    with pytest.raises((TypeError, ValueError)):
        tsock.Consumer(channel, batch_size=bad, timeout=0)
