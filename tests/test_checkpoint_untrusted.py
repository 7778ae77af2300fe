"""Checkpoints as untrusted input (one process; the DCP layout under torchrun is in
tests/test_checkpoint_distributed.py): a value whose unpickling would run code is refused at
save, and checkpoint files rewritten by an attacker who also fixes up the manifest's checksums
never run code at load: the checkpoint is skipped, and `latest()` agrees with `load()`."""

from __future__ import annotations

import io
import os

import pytest
import torch

from shardloader.checkpoint import Checkpointer, CheckpointWarning
from shardloader.checkpoint.untrusted import check_plain, decode_plain
from shardloader.errors import CheckpointError
from tests.fixtures.checkpoint import Evil, evil_pickle, fix_up_manifest


def test_save_refuses_a_value_whose_unpickling_would_run_code(tmp_path):
    marker = str(tmp_path / "ran")
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(CheckpointError, match=r"\['hook'\].*Evil"):
            ck.save(1, cfg={"hook": Evil(marker)})
        assert ck.steps() == []
    assert not os.path.exists(marker)


@pytest.mark.parametrize("target", ["state.safetensors", "state.json"])
def test_a_checkpoint_rewritten_as_a_pickle_is_skipped_without_running_it(tmp_path, target):
    marker = str(tmp_path / "ran")
    root = tmp_path / "ck"
    with Checkpointer(root, keep=None) as ck:
        ck.save(1, x={"v": torch.arange(4.0)}).wait()
        newest = ck.save(2, x={"v": torch.arange(4.0) * 2})
        newest.wait()
        (root / newest.id / target).write_bytes(evil_pickle(marker))
        fix_up_manifest(str(root / newest.id))
        assert ck.steps() == [1, 2]  # the manifest is intact: only content checks can tell
        with pytest.warns(CheckpointWarning, match=newest.id):
            assert ck.latest() == 1
        out: dict = {}
        with pytest.warns(CheckpointWarning, match=newest.id):
            assert ck.load(x=out) == 1
        assert torch.equal(out["v"], torch.arange(4.0))
        with pytest.raises(CheckpointError, match=newest.id):
            ck.load(2, x=out)
    assert not os.path.exists(marker)


def test_plain_data_rule_and_decoder(tmp_path):
    marker = str(tmp_path / "ran")
    plain = {"lr": 0.1, "betas": (0.9, 0.999), "params": ["a.weight"], 3: None, "b": b"\x00",
             "dtype": torch.bfloat16, "shape": torch.Size([2, 3]), "nan": float("nan")}
    check_plain(plain, "group")
    buf = io.BytesIO()
    torch.save(plain, buf)
    decoded = decode_plain(buf.getvalue(), "value 'group'")
    assert decoded.keys() == plain.keys() and decoded["betas"] == (0.9, 0.999)
    with pytest.raises(CheckpointError, match=r"group\['fn'\].*Evil"):
        check_plain({"fn": Evil(marker)}, "group")
    with pytest.raises(CheckpointError, match="value 'group'.*refused without running it"):
        decode_plain(evil_pickle(marker), "value 'group'")
    with pytest.raises(CheckpointError, match="value 'x'.*not plain data"):
        decode_plain(b"not a torch.save archive", "value 'x'")
    assert not os.path.exists(marker)
