"""The sample order of a Pipeline: which dataset indices make up each epoch,
in which order, and in partition mode each rank's share.

Everything here is a pure function of its arguments, computed the same way
in every process, so that any process can find the samples of any batch of
any epoch without having seen the batches before it.

- Whole-dataset order (`epoch_order`): the identity when not shuffling;
  otherwise index i is ranked by a 64-bit key, the splitmix64 finalizer of
  (seed, epoch, i), and the permutation is the indices sorted by key (ties,
  of probability about n^2 / 2^65, broken by index). The definition is
  tsock's own, written out here, so the order does not depend on the numpy
  or torch version, or on either being installed.
- Partition mode (`partition`): torch.utils.data.DistributedSampler's rule,
  with the same permutation generator (torch.randperm with a torch.Generator
  seeded seed + epoch) and the same padding, so that every rank gets exactly
  the indices stock DDP would give it.
"""

from __future__ import annotations

import math

import numpy as np

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

#: Changes whenever the definition of an order changes (part of a Pipeline's fingerprint).
ORDER_VERSION = 1


def _mix(z: int) -> int:
    """splitmix64's finalizer on a Python int (64-bit wrap-around)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray) -> np.ndarray:
    """The same on a uint64 array: numpy's unsigned arithmetic wraps."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def shuffled(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of range(n) for (seed, epoch), as int64."""
    key = _mix(_mix(seed ^ _GOLDEN) ^ epoch)
    base = np.arange(n, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(key)
    return np.argsort(_mix_array(base), kind="stable").astype(np.int64, copy=False)


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The dataset indices of epoch `epoch`, in order (whole-dataset mode)."""
    return shuffled(n, seed, epoch) if shuffle else np.arange(n, dtype=np.int64)


def rank_samples(n: int, world_size: int, drop_last: bool) -> int:
    """Samples per rank and epoch: DistributedSampler's num_samples."""
    if drop_last and n % world_size:
        return math.ceil((n - world_size) / world_size)
    return math.ceil(n / world_size)


def torch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """DistributedSampler's order before padding: torch.randperm(n) from a
    torch.Generator seeded seed + epoch, or range(n)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is installed where partition mode is tested
        raise ImportError(
            "partition mode (world_size=...) orders samples with torch.randperm, as DistributedSampler does: "
            "install torch"
        ) from None
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).numpy().astype(np.int64, copy=False)


def partition(n: int, world_size: int, seed: int, epoch: int, shuffle: bool, drop_last: bool) -> np.ndarray:
    """Every rank's indices of epoch `epoch`: row r of the (world_size,
    num_samples) result is what DistributedSampler(num_replicas=world_size,
    rank=r, shuffle, seed, drop_last) yields. Without drop_last the order is
    repeated from its start to fill the last round (the padding rule); with
    it the tail that does not fill a round is dropped."""
    per_rank = rank_samples(n, world_size, drop_last)
    total = per_rank * world_size
    order = torch_order(n, seed, epoch, shuffle)
    # np.resize repeats the order cyclically (padding) or cuts it (drop_last).
    padded = np.resize(order, total) if total else order[:0]
    # Rank r takes positions r, r + w, r + 2w, ...: column r of rows of w.
    return np.ascontiguousarray(padded.reshape(per_rank, world_size).T)


def sample_sequence(p: dict, epoch: int) -> np.ndarray:
    """The indices a Pipeline computes in epoch `epoch`, in order, from its
    order parameters `p` (Pipeline.order_params(): n, seed, shuffle,
    batch_size, drop_last, world_size (0: whole dataset), ranks,
    sampler_drop_last). Partition mode: step by step, the step's batch of
    each rank of `ranks` in turn, as the Pipeline publishes them."""
    n, bs = p["n"], p["batch_size"]
    if not p["world_size"]:
        order = epoch_order(n, p["seed"], epoch, p["shuffle"])
        return order[: len(order) // bs * bs] if p["drop_last"] else order
    rows = partition(n, p["world_size"], p["seed"], epoch, p["shuffle"], p["sampler_drop_last"])[p["ranks"]]
    per_rank = rows.shape[1]
    steps = per_rank // bs if p["drop_last"] else math.ceil(per_rank / bs)
    full = min(steps, per_rank // bs)
    head = rows[:, : full * bs].reshape(len(p["ranks"]), full, bs).transpose(1, 0, 2).reshape(-1)
    tail = rows[:, full * bs : steps * bs].reshape(-1)  # the last, short step, rank after rank
    return np.concatenate([head, tail])
