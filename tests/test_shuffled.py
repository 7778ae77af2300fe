"""Writing shards in a seeded random order (`write_shards(shuffle=True)`, convert's default):
the order is a pure function of (count, seed), every sample is written once with its bytes
intact, the source order is recoverable, streams are shuffled through a temporary copy that
never outlives the call, and bad requests are clear errors."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shardloader import Dataset
from shardloader.errors import ShardloaderError
from shardloader.ingest.convert import convert
from shardloader.ingest.shuffled import write_permutation
from shardloader.ingest.writer import write_shards


def _samples(n: int) -> list[dict]:
    return [{"data": bytes([i % 251]) * (1 + i % 7), "label": i // 10} for i in range(n)]


def _written(path) -> list[dict]:
    ds = Dataset(path)
    rows = ds.get_many(range(len(ds)))
    ds.close()
    return [{k: v for k, v in r.items() if k != "__index__"} for r in rows]


def test_write_permutation_is_a_pure_permutation():
    p = write_permutation(1000, 7)
    assert sorted(p.tolist()) == list(range(1000))
    assert p.tolist() != list(range(1000))
    assert np.array_equal(p, write_permutation(1000, 7))
    assert not np.array_equal(p, write_permutation(1000, 8))
    assert np.array_equal(np.concatenate([write_permutation(1000, 7, a, a + 300) for a in range(0, 1000, 300)]), p)
    assert write_permutation(1, 7).tolist() == [0] and write_permutation(0, 7).size == 0


@pytest.mark.parametrize("as_stream", [False, True], ids=["sequence", "stream"])
def test_shuffled_write_holds_every_sample_once_in_the_seeded_order(tmp_path, as_stream):
    samples = _samples(157)
    source = iter(samples) if as_stream else samples
    write_shards(source, tmp_path / "out", shard_samples=20, shuffle=True, seed=3, workdir=str(tmp_path))
    rows = _written(tmp_path / "out")
    order = write_permutation(157, 3).tolist()
    assert [r["source_index"] for r in rows] == order  # output j is input perm(j)
    assert [{"data": r["data"], "label": r["label"]} for r in rows] == [samples[i] for i in order]
    assert os.listdir(tmp_path) == ["out"]  # the stream's temporary copy is gone


def test_sequence_and_stream_give_identical_shards(tmp_path):
    write_shards(_samples(90), tmp_path / "a", shard_samples=16, shuffle=True, seed=1)
    write_shards(iter(_samples(90)), tmp_path / "b", shard_samples=16, shuffle=True, seed=1)
    assert Dataset(tmp_path / "a").index.fingerprint == Dataset(tmp_path / "b").index.fingerprint


def test_sorted_input_gives_mixed_shards(tmp_path):
    """The point of it: class-sorted input, every shard holds (nearly) every class."""
    write_shards(_samples(400), tmp_path / "out", shard_samples=50, shuffle=True)
    ds = Dataset(tmp_path / "out")
    for shard in range(ds.index.num_shards):
        start = int(ds.index.sample_offsets[shard])
        labels = {r["label"] for r in ds.get_many(range(start, start + 50))}
        assert len(labels) >= 25  # of 40 classes; source order would give 5


def test_source_index_field_can_be_renamed_or_left_out(tmp_path):
    write_shards(_samples(30), tmp_path / "a", shuffle=True, source_index_field="orig")
    assert sorted(r["orig"] for r in _written(tmp_path / "a")) == list(range(30))
    write_shards(_samples(30), tmp_path / "b", shuffle=True, source_index_field=None)
    assert dict(Dataset(tmp_path / "b").index.schema) == {"data": "binary", "label": "int64"}


def test_resharding_a_shuffled_dataset_keeps_the_original_source_index(tmp_path):
    """A converted dataset converted again (re-sharded, shuffled anew) keeps each sample's
    position in the original source, so the source order stays recoverable."""
    source = _samples(60)
    convert_once = tmp_path / "once"
    write_shards(source, convert_once, shard_samples=16, shuffle=True, seed=1)
    again = tmp_path / "again"
    write_shards(_written(convert_once), again, shard_samples=7, shuffle=True,
                 seed=2)
    records = _written(again)
    assert dict(Dataset(again).index.schema)["source_index"] == "int64"
    assert [r["data"] for r in records] == [source[r["source_index"]]["data"] for r in records]
    first = [r["source_index"] for r in _written(convert_once)]
    assert [r["source_index"] for r in records] != first  # shuffled anew, not copied


def test_existing_dataset_is_refused_before_any_copy(tmp_path):
    write_shards(_samples(10), tmp_path / "out")
    consumed = []

    def stream():
        for s in _samples(10):
            consumed.append(s)
            yield s

    with pytest.raises(ShardloaderError, match="already holds a dataset"):
        write_shards(stream(), tmp_path / "out", shuffle=True, workdir=str(tmp_path))
    assert consumed == [] and sorted(os.listdir(tmp_path)) == ["out"]


def test_empty_stream_is_the_writers_error_naming_the_destination(tmp_path):
    with pytest.raises(ShardloaderError, match=f"{tmp_path / 'out'}: no samples to write"):
        write_shards(iter(()), tmp_path / "out", shuffle=True, workdir=str(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".shardloader-shuffle-")]


def test_a_failing_stream_leaves_no_temporary_copy(tmp_path):
    def stream():
        yield from _samples(20)
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        write_shards(stream(), tmp_path / "out", shuffle=True, workdir=str(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".shardloader-shuffle-")]
    assert not os.path.exists(tmp_path / "out" / "index.json")


def test_convert_shuffles_by_default_and_keeps_order_on_request(image_folder, tmp_path):
    shuffled = convert(image_folder.path, tmp_path / "s", progress=False, seed=5)
    kept = convert(image_folder.path, tmp_path / "k", progress=False, shuffle=False)
    assert (shuffled["shuffled"], shuffled["seed"], kept["shuffled"], kept["seed"]) == (True, 5, False, None)
    rows = _written(tmp_path / "s")
    assert [r["filename"] for r in rows] == [image_folder.files[i] for i in write_permutation(12, 5).tolist()]
    assert [r["filename"] for r in _written(tmp_path / "k")] == image_folder.files
    assert "source_index" not in Dataset(tmp_path / "k").index.schema
