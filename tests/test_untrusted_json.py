"""Deeply nested JSON in data and checkpoints (issue 25 item 9): refused before parsing with the
caller's own error naming the file, never a RecursionError; a damaged checkpoint is skipped
with a warning and the previous one loads."""

from __future__ import annotations

import io
import tarfile

import pytest
import torch

from shardloader import Dataset
from shardloader.checkpoint import Checkpointer, CheckpointWarning
from shardloader.checkpoint.parts import STATE_JSON_DEPTH
from shardloader.errors import CheckpointError, DatasetIndexError, ShardError
from shardloader.ingest.indexer import index_dataset
from shardloader.io.jsondata import MAX_JSON_DEPTH, json_depth, parse_json
from tests.fixtures.checkpoint import fix_up_manifest

DEEP = b"[" * 100_000 + b"]" * 100_000


def test_depth_is_measured_outside_strings_and_the_limit_is_exact():
    assert json_depth(b'{"a": [1, {"b": "[[[{{{"}], "c\\"[": 2}') == 3
    assert parse_json(b'["' + b"[" * 5000 + b'"]', what="x") == ["[" * 5000]
    at_limit = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert json_depth(at_limit) == MAX_JSON_DEPTH
    assert isinstance(parse_json(at_limit, what="x"), list)
    with pytest.raises(ValueError, match=rf"^f.json: JSON nested {MAX_JSON_DEPTH + 1} levels deep"):
        parse_json(b"[" + at_limit + b"]", what="f.json")
    with pytest.raises(DatasetIndexError, match=r"^f.json: not valid JSON \(not UTF-8"):
        parse_json(b'{"a": "\xff"}', what="f.json", error=DatasetIndexError)


def test_a_deep_index_is_a_dataset_index_error_naming_it(tmp_path):
    (tmp_path / "index.json").write_bytes(DEEP)
    with pytest.raises(DatasetIndexError) as info:
        Dataset(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'index.json'}: JSON nested 100000 levels deep")
    assert "more than the 64 levels" in message


def _two_checkpoints(root) -> tuple[Checkpointer, str]:
    ck = Checkpointer(root, keep=None)
    ck.save(1, x={"v": torch.arange(4.0)}).wait()
    newest = ck.save(2, x={"v": torch.arange(4.0) * 2})
    newest.wait()
    return ck, newest.id


def test_a_deep_manifest_is_skipped_and_the_previous_checkpoint_loads(tmp_path):
    root = tmp_path / "ck"
    ck, newest = _two_checkpoints(root)
    with ck:
        (root / newest / "manifest.json").write_bytes(DEEP)
        manifest = str(root / newest / "manifest.json")
        out: dict = {}
        with pytest.warns(CheckpointWarning, match="nested 100000 levels deep") as caught:
            assert ck.load(x=out) == 1
        assert any(manifest in str(w.message) for w in caught)
        assert torch.equal(out["v"], torch.arange(4.0))
        with pytest.warns(CheckpointWarning, match=newest):
            assert ck.latest() == 1


def test_a_deep_state_file_is_skipped_and_the_previous_checkpoint_loads(tmp_path):
    root = tmp_path / "ck"
    ck, newest = _two_checkpoints(root)
    with ck:
        (root / newest / "state.json").write_bytes(DEEP)
        fix_up_manifest(str(root / newest))  # checksums match: only the parse can tell
        out: dict = {}
        with pytest.warns(CheckpointWarning, match=rf"{newest}/state.json: JSON nested 100000 "
                                                   rf"levels deep, more than the {STATE_JSON_DEPTH}"):
            assert ck.load(x=out) == 1
        assert torch.equal(out["v"], torch.arange(4.0))
        with pytest.raises(CheckpointError, match=rf"{newest}/state.json: JSON nested"):
            ck.load(2, x=out)


def test_a_state_too_deep_to_load_is_refused_at_save(tmp_path):
    deep: dict = {}
    node = deep
    for _ in range(STATE_JSON_DEPTH):
        node["d"] = node = {}
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(CheckpointError, match=rf"nests deeper than a checkpoint stores \({STATE_JSON_DEPTH}"):
            ck.save(1, cfg=deep)
        assert ck.steps() == []


def test_a_deep_json_member_of_a_tar_names_the_shard_sample_and_field(tmp_path):
    shard = tmp_path / "a.tar"
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in (("k0.json", b'{"ok": [1, 2]}'), ("k1.json", DEEP)):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tf.addfile(member, io.BytesIO(data))
    index_dataset(str(tmp_path))
    ds = Dataset(tmp_path)
    assert ds[0]["json"] == {"ok": [1, 2]}
    with pytest.raises(ShardError) as info:
        ds[1]
    message = str(info.value)
    assert str(shard) in message and "sample 'k1' field 'json'" in message
    assert "JSON nested 100000 levels deep" in message
    assert Dataset(tmp_path, decode=False)[1]["json"] == DEEP
