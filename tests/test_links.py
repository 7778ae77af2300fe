"""Shards reached through symbolic links (issue 25 item 5): a link leading out of the dataset
root (the shard's own, or a directory's) is refused by a local Dataset and by `verify`, naming
the shard, the link and its target, unless `allow_links_outside_root=True`; links that stay
inside the root work."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from shardloader import Dataset, write_shards
from shardloader.cli.main import main
from shardloader.errors import UnsafePathError
from shardloader.ingest.verify import verify_dataset
from tests.fixtures.data import make_samples

SHARD = "shard-00001.arrow"  # samples 8..15


def _rows(ds: Dataset) -> list[dict]:
    return [{k: v for k, v in ds[i].items() if k != "__index__"} for i in range(len(ds))]


@pytest.fixture
def dataset(tmp_path):
    samples = make_samples(20, seed=4)
    root = tmp_path / "ds"
    write_shards(samples, str(root), shard_samples=8)
    (tmp_path / "elsewhere").mkdir()
    return root, tmp_path / "elsewhere", samples


def _relist(root, old: str, new: str) -> None:
    """Rewrite index.json so that the shard at `old` is listed at `new` (sidecar unchanged)."""
    doc = json.loads((root / "index.json").read_text())
    (entry,) = [s for s in doc["shards"] if s["path"] == old]
    entry["path"] = new
    (root / "index.json").write_text(json.dumps(doc))


def test_a_shard_linked_to_a_file_outside_the_root_is_refused(dataset, capsys):
    root, outside, samples = dataset
    target = outside / SHARD
    os.replace(root / SHARD, target)
    os.symlink(target, root / SHARD)
    ds = Dataset(root)
    assert [{k: v for k, v in r.items() if k != "__index__"} for r in ds.get_many(range(8))] \
        == samples[:8]  # shard 0 is a plain file
    with pytest.raises(UnsafePathError) as info:
        ds[8]
    message = str(info.value)
    assert message.startswith(f"shard {SHARD!r}: {root / SHARD} is a symbolic link to {str(target)!r}")
    assert f"outside the dataset root {root}" in message
    assert "allow_links_outside_root=True" in message

    (problem,) = verify_dataset(root)
    assert problem == message
    assert main(["verify", str(root), "--quiet"]) == 1
    assert f"BAD  {message}" in capsys.readouterr().out

    allowed = Dataset(root, allow_links_outside_root=True)
    assert _rows(allowed) == samples
    assert _rows(pickle.loads(pickle.dumps(allowed))) == samples  # what a spawned worker gets
    assert verify_dataset(root, allow_links_outside_root=True) == []


def test_a_shard_under_a_linked_directory_outside_the_root_is_refused(dataset):
    root, outside, samples = dataset
    os.replace(root / SHARD, outside / SHARD)
    os.symlink(outside, root / "sub")
    _relist(root, SHARD, f"sub/{SHARD}")
    with pytest.raises(UnsafePathError) as info:
        Dataset(root)[8]
    assert str(info.value).startswith(
        f"shard 'sub/{SHARD}': {root / 'sub'} is a symbolic link to {str(outside)!r}")
    assert verify_dataset(root) == [str(info.value)]
    assert _rows(Dataset(root, allow_links_outside_root=True)) == samples


def test_a_relative_link_climbing_out_with_dotdot_is_refused(dataset):
    root, outside, samples = dataset
    os.replace(root / SHARD, outside / SHARD)
    os.symlink(f"../elsewhere/{SHARD}", root / SHARD)
    with pytest.raises(UnsafePathError, match=rf"is a symbolic link to '../elsewhere/{SHARD}' "
                                              rf"\({outside / SHARD}\), outside the dataset root"):
        Dataset(root)[8]
    assert len(verify_dataset(root)) == 1


def test_links_that_stay_inside_the_root_keep_working(dataset, tmp_path):
    root, _, samples = dataset
    (root / "store").mkdir()
    os.replace(root / SHARD, root / "store" / SHARD)
    os.symlink(f"store/{SHARD}", root / SHARD)  # a file link inside the root
    os.symlink("store", root / "linked")  # a directory link inside the root
    shard_2 = "shard-00002.arrow"
    os.replace(root / shard_2, root / "store" / shard_2)
    _relist(root, shard_2, f"linked/{shard_2}")
    os.symlink(root, tmp_path / "root-link")  # the root itself may be a link
    for where in (root, tmp_path / "root-link"):
        assert _rows(Dataset(where)) == samples
        assert verify_dataset(where) == []


def test_the_verify_command_accepts_links_outside_the_root_when_told(dataset, capsys):
    root, outside, _ = dataset
    os.replace(root / SHARD, outside / SHARD)
    os.symlink(outside / SHARD, root / SHARD)
    assert main(["verify", str(root), "--quiet"]) == 1
    assert "--allow-links-outside-root" in capsys.readouterr().out
    assert main(["verify", "--allow-links-outside-root", str(root), "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("ok: 3 shards, 20 samples")
