"""A Consumer's state_dict(): its position in a tsock.Pipeline's order, 48
bytes, from which a new consumer resumes with exactly the batches after the
last one handed out (docs/PIPELINE.md, "Consumer side"). tsock.shared's
catch-up is tested in test_shared.py."""

from __future__ import annotations

import threading

import pipeline_helpers as h
import pytest
import tsock
from tsock import _state


def _batches(pipe, epoch, batch_size=None):
    """The pipeline's batches of an epoch as lists of sample ids, cut into
    batch_size ones (the last one partial) when given."""
    ids = [b[1].tolist() for b in pipe.batches(epoch)]
    if batch_size is None:
        return ids
    flat = sum(ids, [])
    return [flat[i : i + batch_size] for i in range(0, len(flat), batch_size)]


def _checkpoint(channel: str, k: int, epochs: int) -> tuple[list, dict]:
    """A producer of h.make_pipeline() for `epochs`, and a consumer that takes
    k batches then saves its state: (their ids, the state)."""
    serving = Serving(h.make_pipeline(), channel, epochs=epochs)
    with tsock.Consumer(channel, timeout=30) as c:
        got = _first(c, k)
        state = c.state_dict()
    serving.join()
    return got, state


def _ids(batch) -> list:
    return batch[1].tolist()


def _first(consumer, k: int) -> list:
    it = iter(consumer)
    return [_ids(next(it)) for _ in range(k)]


class Serving:
    """Producer(pipe).run(epochs, start) in a thread; join() re-raises."""

    def __init__(self, pipe, channel, epochs, start=None, **options):
        self.error = None
        self.producer = tsock.Producer(pipe, channel, wait_readers=1, **options)
        self.thread = threading.Thread(target=self._run, args=(epochs, start), daemon=True)
        self.thread.start()

    def _run(self, epochs, start):
        try:
            self.producer.run(epochs=epochs, start=start)
        except BaseException as e:  # noqa: BLE001 - re-raised by join()
            self.error = e

    def join(self):
        self.thread.join(60)
        self.producer.close()
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("batch_size", [None, 3, 10])
def test_a_job_restarted_from_a_checkpoint_gets_the_batches_after_it(channel, batch_size):
    """Producer and consumer restarted from the consumer's state: the rest of
    the epoch in the same batches as a run never interrupted, re-batched
    ones included (a state part of the way into a producer batch)."""
    ref = h.make_pipeline()
    serving = Serving(h.make_pipeline(), channel, epochs=2)
    with tsock.Consumer(channel, batch_size=batch_size, timeout=30) as c:
        for _ in c:  # epoch 0
            pass
        got = _first(c, 5)
        state = c.state_dict()
    serving.join()
    decoded = _state.decode(state)
    assert len(state["tsock"]) == 48 and (decoded.epoch, decoded.samples) == (1, 5 * (batch_size or 4))
    assert (decoded.samples % 4 != 0) == (batch_size is not None)  # re-batched: part of the way into a batch
    serving = Serving(h.make_pipeline(), channel, epochs=3, start=state)
    with tsock.Consumer(channel, batch_size=batch_size, timeout=30, state=state) as c:
        rest = [_ids(b) for b in c]
        following = [_ids(b) for b in c]
    serving.join()
    assert got + rest == _batches(ref, 1, batch_size)
    assert following == _batches(ref, 2, batch_size)


def test_a_stream_behind_the_state_is_read_up_to_it(channel):
    """Attached before the producer gets to the state's position (it runs
    from the start of the epoch): the batches before it are let go."""
    ref = h.make_pipeline()
    got, state = _checkpoint(channel, 7, epochs=2)
    serving = Serving(h.make_pipeline(), channel, epochs=1)  # epoch 0 from its first batch
    with tsock.Consumer(channel, timeout=30) as c:
        c.load_state_dict(state)
        rest = [_ids(b) for b in c]
    serving.join()
    assert got + rest == _batches(ref, 0)


def test_a_stream_past_the_state_is_refused_naming_the_fix(channel):
    serving = Serving(h.make_pipeline(), channel, epochs=1)
    with tsock.Consumer(channel, timeout=30) as c:
        _first(c, 2)
        state = c.state_dict()
    serving.join()
    serving = Serving(h.make_pipeline(), channel, epochs=1, start=(0, 6))
    try:
        with tsock.Consumer(channel, timeout=30, state=state) as c:
            with pytest.raises(ValueError, match=r"past the state's position.*run\(start=.*tsock.shared"):
                next(iter(c))
    finally:
        serving.producer.close()
        serving.thread.join(60)


def test_a_state_of_another_pipeline_or_not_a_state_is_refused(channel):
    serving = Serving(h.make_pipeline(n=40), channel, epochs=1)
    with tsock.Consumer(channel, timeout=30) as c:
        _first(c, 2)
        state = c.state_dict()
        with pytest.raises(ValueError, match="before the consumer's first batch"):
            c.load_state_dict(state)
    serving.join()
    other = h.make_pipeline(n=44)  # another source: another fingerprint
    with pytest.raises(ValueError, match="another pipeline"):
        tsock.Producer(other, channel).run(start=state)
    serving = Serving(other, channel, epochs=1)
    try:
        with tsock.Consumer(channel, timeout=30, state=state) as c:
            with pytest.raises(ValueError, match="another pipeline"):
                next(iter(c))
    finally:
        serving.producer.close()
        serving.thread.join(60)
    for bad in ({"tsock": b"TSS1"}, {"state": bytes(48)}, [1, 2]):
        with pytest.raises(ValueError, match="tsock loader state"):
            tsock.Consumer(channel, timeout=0, state=bad)


def test_a_producer_of_plain_batches_has_no_state(channel):
    with tsock.Producer([(h.np.zeros((2, 3)),)] * 3, channel, wait_readers=1) as p:
        t = threading.Thread(target=p.run, daemon=True)
        t.start()
        with tsock.Consumer(channel, timeout=30) as c:
            next(iter(c))
            with pytest.raises(TypeError, match="publish a tsock.Pipeline"):
                c.state_dict()
        t.join(30)


@pytest.mark.parametrize("rank", [0, 2])
def test_a_rank_resumes_its_share(channel, rank):
    """A partitioned channel: rank r of 3's state; the producer restarted at
    it (the start of its step) and the rank gets the rest of its share."""
    make = lambda: h.make_pipeline(n=47, batch_size=3, world_size=3)  # noqa: E731
    serving = Serving(make(), channel, epochs=2)
    with tsock.Consumer(channel, timeout=30, rank=rank, world_size=3) as c:
        got = _first(c, 3)
        state = c.state_dict()
    serving.producer.close()
    serving.thread.join(60)
    with pytest.raises(ValueError, match="rank"):
        tsock.Consumer(channel, timeout=0, state=state, rank=1, world_size=3)
    serving = Serving(make(), channel, epochs=1, start=state)
    with tsock.Consumer(channel, timeout=30, rank=rank, world_size=3, state=state) as c:
        rest = [_ids(b) for b in c]
    serving.join()
    assert sum(got + rest, []) == make().indices(0, rank=rank).tolist()


# ---- a DataLoader as a Pipeline ----


def _dataloader(**kw):
    import torch
    from torch.utils.data import DataLoader

    kw.setdefault("batch_size", 4)
    return DataLoader(h.Numbers(60), **kw), torch


def test_a_seeded_map_style_dataloader_is_published_as_a_pipeline_and_resumes(channel):
    loader, torch = _dataloader(shuffle=True, generator=torch_generator(5), num_workers=2)
    producer = tsock.Producer(loader, channel, wait_readers=1)
    try:
        assert isinstance(producer.loader, tsock.Pipeline) and producer.dataloader is loader
        assert producer.not_resumable is None
        assert (producer.loader.seed, producer.loader.shuffle, producer.loader.workers) == (5, True, 2)
        t = threading.Thread(target=_run_until_closed, args=(producer,), daemon=True)
        t.start()
        with tsock.Consumer(channel, output="torch", timeout=30) as c:
            got = _first(c, 4)
            state = c.state_dict()
        producer.close()
        t.join(60)
    finally:
        producer.close()
    reference, _ = _dataloader(shuffle=True, generator=torch_generator(5))
    with tsock.Producer(reference, channel + "r") as ref_producer:  # the same Pipeline, computed here
        expected = [b[1].tolist() for b in ref_producer.loader.batches(0)]
    assert sorted(sum(expected, [])) == list(range(60))  # every sample once: shuffled by the seed
    assert got == expected[:4]
    serving = Serving(_dataloader(shuffle=True, generator=torch_generator(5))[0], channel, epochs=1, start=state)
    with tsock.Consumer(channel, output="torch", timeout=30, state=state) as c:
        rest = [_ids(b) for b in c]
    serving.join()
    assert got + rest == expected


def _run_until_closed(producer) -> None:
    try:
        producer.run(epochs=1)
    except tsock.TsockError:
        assert producer._closed  # closed under it: how the test stops it


def torch_generator(seed: int):
    import torch

    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


@pytest.mark.parametrize(
    "options, why",
    [
        ({"shuffle": True}, "without a seeded generator"),
        ({"batch_size": None}, "batch_sampler"),
        ({"sampler": [3, 1, 2]}, "sampler is a list"),
        ({"worker_init_fn": print}, "worker_init_fn"),
    ],
)
def test_any_other_dataloader_is_published_as_it_is_and_says_why(channel, options, why):
    loader, _ = _dataloader(**options)
    with tsock.Producer(loader, channel) as producer:
        assert producer.loader is loader and producer.dataloader is None
        assert why in producer.not_resumable
        with pytest.raises(ValueError, match=f"not one: .*{why}"):
            producer.run(start=(0, 1))


def test_the_state_after_an_epoch_is_the_next_epoch_whatever_ended_it(channel):
    """After the last batch drop_last hands out, and after a break and a new
    iter() (which drops the rest): the next epoch's start (review 28: the
    resumed loop was empty, or got the dropped rest)."""
    serving = Serving(h.make_pipeline(), channel, epochs=1)  # 60 samples
    with tsock.Consumer(channel, batch_size=7, drop_last=True, timeout=30) as c:
        assert len([b for b in c]) == 8  # 4 samples dropped
        assert _state.decode(c.state_dict())[1:4] == (1, 0, 0)
    serving.join()
    serving = Serving(h.make_pipeline(), channel, epochs=2)
    with tsock.Consumer(channel, timeout=30) as c:
        _first(c, 3)
        assert _state.decode(c.state_dict())[1:4] == (0, 12, 3)
        iter(c)  # a new epoch: the rest of epoch 0 is dropped
        assert _state.decode(c.state_dict())[1:4] == (1, 0, 0)
        assert len(c) == 15
    serving.producer.close()
    serving.thread.join(60)


def test_load_state_dict_after_len(channel):
    ref = h.make_pipeline()
    got, state = _checkpoint(channel, 5, epochs=1)
    serving = Serving(h.make_pipeline(), channel, epochs=1, start=state)
    with tsock.Consumer(channel, timeout=30, start="now") as c:
        assert len(c) == 15  # peeks the first batch: sizes the schedule first
        c.load_state_dict(state)
        rest = [_ids(b) for b in c]
    serving.join()
    assert got + rest == _batches(ref, 0)
