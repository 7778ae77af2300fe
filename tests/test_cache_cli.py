"""`shardloader cache verify|info|prune DIR`."""

from __future__ import annotations

import hashlib
import os

import pytest

from shardloader.cli.main import main
from shardloader.ingest.writer import write_shards
from shardloader.source.remote import RemoteSource


@pytest.fixture
def filled_cache(tmp_path):
    ds = str(tmp_path / "ds")
    samples = [{"data": hashlib.sha256(str(i).encode()).digest() * 30, "label": i} for i in range(60)]
    index = write_shards(samples, ds, shard_samples=20)
    cache = str(tmp_path / "cache")
    src = RemoteSource("file://" + ds, cache_dir=cache, cache_limit="10MB")
    paths = []
    for info in index.shards:
        paths.append(src.local_path(info))
        src.release(info)
    src.close()
    return cache, paths, index


def test_verify_passes_on_a_good_cache(filled_cache, capsys):
    cache, _, _ = filled_cache
    assert main(["cache", "verify", cache]) == 0
    assert capsys.readouterr().out.strip().endswith(f"3 ok, 0 bad in {cache}")


def test_verify_names_a_damaged_file_and_can_remove_it(filled_cache, capsys):
    cache, paths, _ = filled_cache
    with open(paths[1], "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    assert main(["cache", "verify", cache]) == 1
    out = capsys.readouterr().out
    assert f"BAD  {paths[1]}: hashes to" in out and "2 ok, 1 bad" in out
    assert os.path.exists(paths[1])
    assert main(["cache", "verify", "--remove", cache]) == 1
    assert "(removed)" in capsys.readouterr().out
    assert not os.path.exists(paths[1])
    assert main(["cache", "verify", cache]) == 0


def test_info_and_prune(filled_cache, capsys):
    cache, paths, index = filled_cache
    assert main(["cache", "info", cache]) == 0
    assert "3 shards" in capsys.readouterr().out
    assert main(["cache", "prune", cache, "--to", str(index.shards[2].bytes)]) == 0
    assert "evicted 2 shards" in capsys.readouterr().out
    assert [os.path.exists(p) for p in paths] == [False, False, True]  # least recently used first
    assert main(["cache", "prune", cache, "--to", "0"]) == 0
    assert not any(os.path.exists(p) for p in paths)


def test_a_folder_that_is_not_a_cache_is_refused(tmp_path, capsys):
    assert main(["cache", "verify", str(tmp_path)]) == 1
    assert "not a shardloader cache directory" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # nothing was created there
