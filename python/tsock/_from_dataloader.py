"""A torch DataLoader as a tsock.Pipeline, where that keeps its meaning: a
seeded map-style DataLoader (a dataset with len() and [i], batch_size,
shuffle with a seeded generator= or no shuffle, the default batch sampler)
becomes the Pipeline of the same dataset, batch size, drop_last, collate_fn
and workers, with the generator's seed. Its batches are then positions in
a known order: a producer restarts at the exact batch, and a consumer's
state resumes (docs/PIPELINE.md, "Consumer side"). The order is the
Pipeline's permutation for that seed, not the one RandomSampler would draw.

Any other DataLoader stays as it is, published as an iterable: a restart
starts its epoch over, and `why_not` says why.
"""

from __future__ import annotations

import sys

SEED_MASK = (1 << 63) - 1  # a Pipeline's seed range


def convert(loader):
    """(pipeline, None) for a DataLoader that converts, (None, why) for one
    that does not, (None, None) for anything that is not a DataLoader."""
    if "torch" not in sys.modules:
        return None, None  # not a DataLoader: torch would be imported
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader):
        return None, None
    why = why_not(loader)
    if why is not None:
        return None, why
    from .pipeline import Pipeline

    shuffle, seed = _order(loader)
    return (
        Pipeline(
            loader.dataset,
            batch_size=loader.batch_size,
            collate=loader.collate_fn,
            shuffle=shuffle,
            seed=seed,
            drop_last=loader.drop_last,
            workers=loader.num_workers,
            prefetch=loader.prefetch_factor or 2,
            timeout=loader.timeout or None,
            version="torch.utils.data.DataLoader",
        ),
        None,
    )


def why_not(loader) -> str | None:
    """Why a DataLoader's order is not known to be reproducible, or None."""
    from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

    if isinstance(loader.dataset, IterableDataset):
        return "its dataset is an IterableDataset: there is no index to seek to"
    if not hasattr(loader.dataset, "__len__"):
        return "its dataset has no len()"
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        return "it has a batch_sampler of its own (or batch_size=None)"
    if loader.worker_init_fn is not None:
        return "it has a worker_init_fn (a Pipeline's workers do not call it)"
    if loader.multiprocessing_context is not None:
        return "it names a multiprocessing_context"
    sampler = loader.sampler
    if type(sampler) is SequentialSampler:
        return None
    if type(sampler) is not RandomSampler:
        return f"its sampler is a {type(sampler).__name__}, whose order tsock does not know"
    if sampler.replacement or sampler._num_samples is not None:
        return "its RandomSampler draws with replacement or a num_samples of its own"
    if sampler.generator is None:
        return (
            "it shuffles without a seeded generator (give DataLoader(..., shuffle=True, "
            "generator=torch.Generator().manual_seed(SEED)))"
        )
    return None


def _order(loader) -> tuple[bool, int]:
    from torch.utils.data import RandomSampler

    if type(loader.sampler) is RandomSampler:
        return True, loader.sampler.generator.initial_seed() & SEED_MASK
    return False, 0
