"""A Loader as a torchdata.nodes source node: a torchdata pipeline (Mapper, Prefetcher,
nodes.Loader) around it saves its state and resumes exactly, under another num_workers."""

from __future__ import annotations

import pytest
import torch
import torchdata.nodes as tn
from torch.utils.data import Dataset

from shardloader import Loader, LoaderNode
from tests.resume import assert_same_batches, plain_state, record

N = 70
BATCH = 16  # 5 batches per epoch, the last one short


class Augmented(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.rand(4) + i, i  # torch.rand: keyed per sample by the Loader


def _with_indices(batch: list) -> dict:
    """A batch-level stage: the samples' indices travel with the batch (labels here are i)."""
    features, labels = batch
    return {"features": features * 2, "__index__": labels}


def pipeline(num_workers: int, prefetch: bool = True) -> tn.Loader:
    loader = Loader(Augmented(), batch_size=BATCH, shuffle=True, seed=7, num_workers=num_workers)
    node = tn.Mapper(LoaderNode(loader), _with_indices)
    return tn.Loader(tn.Prefetcher(node, prefetch_factor=2) if prefetch else node)


def take_epochs(pipe: tn.Loader, epochs: int) -> list:
    out = []
    for _ in range(epochs):
        out.extend(record(b) for b in pipe)
    return out


def test_each_pass_is_the_next_epoch_with_every_sample_once():
    batches = take_epochs(pipeline(0), 2)
    assert len(batches) == 10
    first = [i for b in batches[:5] for i in b.indices]
    second = [i for b in batches[5:] for i in b.indices]
    assert sorted(first) == sorted(second) == list(range(N)) and first != second


# The first segment's Prefetcher thread keeps running (torchdata has no public close), so the
# resumed pipeline must not fork worker processes beside it while it reads inline: a fork can
# copy a lock that thread holds (torch's generator mutex) into the workers, as with DataLoader.
# Hence 2 workers -> inline with prefetching, and inline -> 2 workers without.
@pytest.mark.parametrize("cut,before,after,prefetch", [
    (0, 2, 0, True), (2, 2, 0, True), (5, 2, 0, True), (7, 2, 0, True), (3, 0, 2, False), (6, 0, 2, False),
])
def test_pipeline_state_resumes_exactly_under_another_worker_count(cut, before, after, prefetch):
    reference = take_epochs(pipeline(0), 2)
    pipe = pipeline(before, prefetch)
    got = []
    it = iter(pipe)
    for _ in range(min(cut, 5)):
        got.append(record(next(it)))
    if cut >= 5:  # cross into the second epoch
        assert next(it, None) is None
        it = iter(pipe)
        for _ in range(cut - 5):
            got.append(record(next(it)))
    state = plain_state(pipe.state_dict())
    resumed = pipeline(after, prefetch)
    resumed.load_state_dict(state)
    rest = []
    while len(got) + len(rest) < 10:
        batches = [record(b) for b in resumed]
        assert batches, "the resumed pipeline produced nothing"
        rest.extend(batches)
    assert_same_batches(got + rest, reference, f"torchdata pipeline resumed after {cut} batches")


def test_node_state_is_the_loaders_cursor_and_wrong_state_is_refused():
    loader = Loader(Augmented(), batch_size=BATCH, shuffle=True)
    node = LoaderNode(loader)
    next(node)
    next(node)
    assert node.state_dict() == {"loader": loader.state_dict()}
    assert loader.state_dict()["position"] == 2 * BATCH
    with pytest.raises(ValueError, match="'loader'"):
        node.reset({"position": 3})
    with pytest.raises(TypeError, match="shardloader Loader"):
        LoaderNode(object())
