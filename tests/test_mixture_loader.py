"""A Mixture under the Loader: killed and resumed, with other worker counts and world sizes, and
with new weights at a resume (issue 38, part 2).

Every batch is compared by its sample indices and the bytes of its augmented tensor (the
Loader's transform draws from torch's global RNG, keyed per sample)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.mixture_train import BATCH, make_loader
from tests.proctree import descendants
from tests.resume import plain_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
       "OMP_NUM_THREADS": "1"}
TOTAL = 40  # batches: the mixture's epoch is 240 positions, 30 batches


def _train(data: str, out: str, *extra: str, kill_after: int | None = None) -> None:
    cmd = [sys.executable, "-m", "tests.mixture_train", "--data", data, "--out", out,
           "--batches", str(TOTAL), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout is not None
    if kill_after is not None:
        for line in proc.stdout:
            if line.strip() == f"batch {kill_after}":
                for p in descendants(proc.pid):  # the workers too: nothing finishes the epoch
                    os.kill(p.pid, signal.SIGKILL)
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
        return
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def _batches(out: str) -> list[dict]:
    with open(os.path.join(out, "batches.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_killed_and_resumed_with_fewer_workers_equals_the_uninterrupted_run(arrow_dataset, tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    _train(arrow_dataset.path, str(reference), "--workers", "2")
    expected = _batches(str(reference))
    assert len(expected) == TOTAL
    run = tmp_path / "killed"
    run.mkdir()
    _train(arrow_dataset.path, str(run), "--workers", "2", kill_after=13)
    with open(run / "state.json") as f:
        saved = json.load(f)["batches"]  # the state may be past batch 13: the kill is not instant
    before = _batches(str(run))[:saved]
    _train(arrow_dataset.path, str(run), "--workers", "1", "--resume")  # 2 -> 1 workers
    got = before + _batches(str(run))[len(_batches(str(run))) - (TOTAL - saved):]
    assert [b["indices"] for b in got] == [b["indices"] for b in expected]
    assert got == expected  # indices, labels and the augmented bytes, bit for bit
    indices = np.array([i for b in expected[:30] for i in b["indices"]])
    assert (indices >= 200).any() and (indices < 200).any()  # both sources drawn


def _record(batch: dict) -> tuple[list[int], bytes]:
    return batch["__index__"].tolist(), batch["x"].numpy().tobytes()


def test_world_size_two_to_one_continues_the_same_global_batches(arrow_dataset):
    steps, cut = 34, 12
    single = make_loader(arrow_dataset.path, num_workers=1)
    reference = []
    for epoch in range(2):
        single.set_epoch(epoch)
        reference.extend(_record(b) for b in single)
    single.close()
    reference = reference[:steps]
    ranks = [make_loader(arrow_dataset.path, batch_size=BATCH // 2, rank=r, world_size=2) for r in range(2)]
    streams = [iter(loader) for loader in ranks]
    for step in range(cut):
        parts = [_record(next(s)) for s in streams]
        merged = [None] * BATCH
        merged[0::2], merged[1::2] = parts[0][0], parts[1][0]
        assert merged == reference[step][0], f"step {step}"
        x = np.frombuffer(reference[step][1], dtype=np.float32).reshape(BATCH, 3)
        assert x[0::2].tobytes() == parts[0][1] and x[1::2].tobytes() == parts[1][1]
    state = plain_state(ranks[0].state_dict())
    assert state == plain_state(ranks[1].state_dict())
    for loader in ranks:
        loader.close()
    resumed = make_loader(arrow_dataset.path, num_workers=2)
    resumed.load_state_dict(state)
    rest = []
    for epoch in range(resumed.epoch, 2):
        resumed.set_epoch(epoch)
        rest.extend(_record(b) for b in resumed)
    resumed.close()
    assert rest[:steps - cut] == reference[cut:]


def test_new_weights_at_a_resume_read_nothing_of_the_current_passes_twice(arrow_dataset):
    sizes = {"arrow": 200, "squares": 37}
    first = make_loader(arrow_dataset.path, weights=(0.5, 0.5), num_workers=2)
    read = [i for _, b in zip(range(17), first) for i in b["__index__"].tolist()]
    state = plain_state(first.state_dict())
    first.close()
    passes = state["sampler"]["sources"]
    assert passes["squares"]["pass"] >= 1  # the small source is on a later pass already
    resumed = make_loader(arrow_dataset.path, weights=(0.9, 0.1), num_workers=2)
    resumed.load_state_dict(state)  # the weights are no part of the fingerprint
    after = []
    for epoch in range(resumed.epoch, 3):
        resumed.set_epoch(epoch)
        after.extend(i for b in resumed for i in b["__index__"].tolist())
    resumed.close()
    reread = 0
    for name, offset in (("arrow", 0), ("squares", 200)):
        n, in_pass = sizes[name], passes[name]["in_pass"]
        mine = [i - offset for i in read if offset <= i < offset + n]
        this_pass = mine[len(mine) - in_pass:] if in_pass else []
        rest = [i - offset for i in after if offset <= i < offset + n][:n - in_pass]
        assert len(rest) == n - in_pass  # the pass was finished after the resume
        reread += len(set(this_pass) & set(rest))
        assert sorted(this_pass + rest) == list(range(n))  # every sample of the pass, once
    assert reread == 0
    arrow_share = np.mean([i < 200 for i in after[BATCH * 20:]])
    assert 0.85 < arrow_share < 0.95  # the new weights hold


def test_stats_give_each_sources_samples_and_read_time(arrow_dataset):
    loader = make_loader(arrow_dataset.path, num_workers=2)
    read = [i for b in loader for i in b["__index__"].tolist()]
    stats = loader.stats()
    loader.close()
    assert stats["source.arrow.samples"] == sum(i < 200 for i in read) > 0
    assert stats["source.squares.samples"] == sum(i >= 200 for i in read) > 0
    assert stats["source.arrow.read_seconds_total"] > 0 and stats["source.squares.read_seconds_total"] > 0
    assert stats["source.arrow.shard_wait_seconds_total"] >= 0
    assert stats["source.arrow.bytes_downloaded"] == 0  # a local source downloads nothing


def test_a_source_added_at_a_resume_starts_its_pass_and_the_others_continue(arrow_dataset):
    import warnings

    import shardloader
    from tests.mixture_train import Squares, square_fields

    first = make_loader(arrow_dataset.path, weights=(0.5, 0.5))
    read = [i for _, b in zip(range(5), first) for i in b["__index__"].tolist()]
    state = plain_state(first.state_dict())
    first.close()
    mix = shardloader.Mixture({
        "arrow": shardloader.MixtureSource(shardloader.Dataset(arrow_dataset.path), 0.4, first.dataset.transforms[0]),
        "squares": shardloader.MixtureSource(Squares(37), 0.4, square_fields),
        "extra": shardloader.MixtureSource(Squares(11), 0.2, square_fields),
    }, epoch=240)
    resumed = shardloader.Loader(mix, batch_size=BATCH, shuffle=True, seed=5, tail="pad",
                                 transform=first.transform)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state, strict=False)  # the sources changed: so does the fingerprint
    assert any("index" in str(w.message) for w in caught)
    after = [i for b in resumed for i in b["__index__"].tolist()]
    resumed.close()
    in_pass = state["sampler"]["sources"]["squares"]["in_pass"]
    squares_before = [i for i in read if 200 <= i < 237]
    this_pass = squares_before[len(squares_before) - in_pass:] if in_pass else []
    squares_after = [i for i in after if 200 <= i < 237][:37 - in_pass]
    assert not set(this_pass) & set(squares_after)
    extra = [i - 237 for i in after if i >= 237]
    assert sorted(extra[:11]) == list(range(11))  # the new source's first pass, whole


def test_the_job_account_gives_each_sources_figures(arrow_dataset, tmp_path):
    """Issue 38 part 2: the job's account, and its report, give each mixture source's samples,
    shard wait, read seconds and bytes: over two attempts (the first saves mid-epoch, the second
    resumes and finishes the epoch), the sums of what each attempt's `Loader.stats()` said."""
    from shardloader.checkpoint import Checkpointer
    from shardloader.telemetry.job.account import account
    from shardloader.telemetry.job.read import read_job_dir
    from shardloader.telemetry.job.render import render_job_text

    root = str(tmp_path / "ckpt")
    stats = []
    with Checkpointer(root) as ckpt:
        loader = make_loader(arrow_dataset.path, num_workers=2)
        for _ in zip(range(5), loader):
            pass
        ckpt.save(5, loader=loader).wait()
        stats.append(loader.stats())
        loader.close()
    with Checkpointer(root) as ckpt:
        loader = make_loader(arrow_dataset.path, num_workers=2)
        ckpt.load(loader=loader)
        rest = sum(1 for _ in loader)
        stats.append(loader.stats())
        loader.close()
    assert rest > 0
    report = account(read_job_dir(root))
    sources = report["sources"]
    assert sorted(sources) == ["arrow", "squares"]
    for name, figures in sources.items():
        for figure, key in (("samples", "samples"), ("read_seconds", "read_seconds_total"),
                            ("shard_wait_seconds", "shard_wait_seconds_total"),
                            ("bytes_downloaded", "bytes_downloaded")):
            expected = sum(s[f"source.{name}.{key}"] for s in stats)
            assert figures[figure] == pytest.approx(expected, rel=1e-9, abs=1e-12), (name, figure)
    assert sum(f["samples"] for f in sources.values()) == report["samples"]["trained"]
    text = render_job_text(report)
    assert "sources" in text
    for name, figures in sources.items():
        assert any(line.split()[:2] == [name, f"{int(figures['samples']):,}"] for line in text.splitlines()), text
