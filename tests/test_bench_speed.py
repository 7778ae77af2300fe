"""benchmarks/speed.py's table: the best peer per figure (either direction), ours / best peer,
the goal check, and n/a cells that say why."""

from __future__ import annotations

import pytest

from benchmarks.speed import OURS, Figure, figures, render

COLUMNS = [OURS, "FFCV", "torch DataLoader", "litdata"]


def cells(text: str, figure: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {figure} "))
    return [c.strip() for c in line.strip("|").split("|")]


def test_higher_is_better_picks_the_fastest_peer_and_checks_the_goal():
    f = Figure("samples/s", "{:,.0f}", True, {OURS: 6000.0, "FFCV": 5000.0,
                                               "torch DataLoader": 4000.0},
               goal="≥ 1.2× FFCV", check=lambda o, p: o >= 1.2 * p["FFCV"])
    assert f.best_peer() == ("FFCV", 5000.0)
    assert f.ours_to_best() == 6000.0 / 5000.0
    assert f.met() == "yes"
    row = cells(render([f], COLUMNS), "samples/s")
    assert row == ["samples/s", "6,000", "5,000", "4,000", "-", "FFCV 5,000", "1.20",
                   "≥ 1.2× FFCV", "yes"]


def test_lower_is_better_picks_the_smallest_peer():
    f = Figure("first batch", "{:.2f}", False, {OURS: 0.5, "FFCV": 9.0, "litdata": 0.2},
               goal="≤ 0.2 s", check=lambda o, p: o <= 0.2)
    assert f.best_peer() == ("litdata", 0.2)
    assert f.ours_to_best() == 0.5 / 0.2
    assert f.met() == "no"


def test_a_ratio_measured_per_round_wins_over_the_ratio_of_values():
    f = Figure("samples/s", "{:,.0f}", True, {OURS: 6000.0, "FFCV": 5000.0}, ratio=1.1)
    assert f.ours_to_best() == 1.1


def test_the_goal_of_a_per_round_ratio_is_checked_on_the_ratio_shown():
    """Medians 2,940 vs 3,100 (0.948) but per-round ratios with median 0.97: "met" must agree
    with the ratio column, in both directions."""
    kw = dict(goal="≥ 0.95× best peer", check=lambda o, p: o >= 0.95 * max(p.values()),
              ratio_check=lambda r, p: r >= 0.95)
    shown_met = Figure("parity", "{:,.0f}", True, {OURS: 2940.0, "FFCV": 3100.0}, ratio=0.97, **kw)
    assert shown_met.met() == "yes"
    shown_missed = Figure("parity", "{:,.0f}", True, {OURS: 3000.0, "FFCV": 3100.0}, ratio=0.94, **kw)
    assert shown_missed.met() == "no"


def test_unmeasured_cells_are_na_with_the_reason_under_the_table():
    f = Figure("peak RSS", "{:,.0f}", False, {OURS: 900.0},
               why={"torch DataLoader": "failed: boom", "FFCV": "not installed here"},
               goal="≤ DataLoader's", check=lambda o, p: o <= p["torch DataLoader"])
    assert f.best_peer() is None and f.ours_to_best() is None
    assert f.met() == "n/a (torch DataLoader not measured)"
    text = render([f], COLUMNS)
    assert cells(text, "peak RSS")[1:5] == ["900", "n/a", "n/a", "-"]
    assert "- FFCV: not installed here" in text
    assert "- torch DataLoader: failed: boom" in text


def test_a_column_with_several_reasons_names_the_figures_of_each():
    rss = Figure("peak RSS", "{:,.0f}", False, {OURS: 1.0}, why={"litdata": "not installed"})
    cold = Figure("cold", "{:.2f}", False, {OURS: 1.0}, why={"litdata": "no S3 endpoint"})
    pss = Figure("peak PSS", "{:,.0f}", False, {OURS: 1.0}, why={"litdata": "not installed"})
    text = render([rss, cold, pss], COLUMNS)
    assert "- litdata (peak RSS; peak PSS): not installed" in text
    assert "- litdata (cold): no S3 endpoint" in text


def test_a_reference_row_has_no_best_peer_and_no_goal():
    f = Figure("limit", "{:,.0f}", None, {OURS: 8000.0, "FFCV": 1.0})
    assert f.best_peer() is None and f.ours_to_best() is None and f.met() == "-"


def _raw(in_process: dict) -> dict:
    return {"in_process": {"cores": 2, "limits": {"antialias": [], "linear": [10.0], "whole": []},
                           "stalls": {}, **in_process},
            "isolated": {}, "cold": {}, "why": {}, "columns": [OURS]}


def test_each_epoch_is_compared_with_the_limit_measured_just_before_it():
    """Rates 8k, 6k, 9k against limits 10k, 6k, 9k measured just before each epoch: fractions
    0.8, 1.0, 1.0 (median 1.0), where the median limit (9k) would give 0.89; CPU efficiency =
    the loop's CPU per sample (cores / limit) over the loader's, per epoch (0.8, 0.5, 0.9)."""
    raw = _raw({"rates": {f"{OURS}|fast": [8000.0, 6000.0, 9000.0]},
                "epoch_limits": {f"{OURS}|fast": [10000.0, 6000.0, 9000.0]},
                "epoch_cpu": {f"{OURS}|fast": [2 / 8000, 2 / 3000, 2 / 8100]}})
    by_name = {f.name.split(" (")[0].strip(): f for f in figures(raw)}
    assert by_name["fraction of the fast stack's limit"].values[OURS] == 1.0
    assert by_name["CPU efficiency: the loop's CPU per sample ÷ the loader's"].values[OURS] == \
        pytest.approx(0.8)


def test_a_run_saved_before_per_epoch_limits_uses_the_limit_of_its_round():
    raw = _raw({"rates": {f"{OURS}|fast": [8000.0, 6000.0]},
                "limits": {"antialias": [10000.0, 10000.0], "linear": [1.0], "whole": []}})
    by_name = {f.name.split(" (")[0].strip(): f for f in figures(raw)}
    assert by_name["fraction of the fast stack's limit"].values[OURS] == pytest.approx(0.7)
    assert OURS not in by_name["CPU efficiency: the loop's CPU per sample ÷ the loader's"].values


# -- the own-function rows (issue 24) ----------------------------------------------------------


def test_the_own_function_gives_the_readme_pixels_for_the_same_generator_seed(jpeg_dataset):
    """`peers.own_transform` is the README transform wrapped in user code: for the same
    generator seed, the same CHW uint8 bytes under another field name, and the label."""
    import torch

    from benchmarks.peers import SIZE, loader_transform, own_transform

    readme = loader_transform("readme")
    for i, sample in enumerate(jpeg_dataset.samples):
        want = readme(sample, generator=torch.Generator().manual_seed(1000 + i))["image"]
        got = own_transform(sample, generator=torch.Generator().manual_seed(1000 + i))
        assert set(got) == {"img", "label"} and got["label"] == sample["label"]
        assert got["img"].dtype == torch.uint8 and got["img"].shape == (3, SIZE, SIZE)
        assert torch.equal(got["img"], want)
    # the equality is not that of a constant: another seed is another crop
    other = own_transform(jpeg_dataset.samples[0], generator=torch.Generator().manual_seed(7))["img"]
    assert not torch.equal(other, readme(jpeg_dataset.samples[0],
                                         generator=torch.Generator().manual_seed(1000))["image"])


def test_the_loader_gives_the_same_batches_for_the_own_function_as_for_the_readme_transform(
        jpeg_dataset):
    """Through the Loader (its direct path for the README transform, its general path for the
    user's function): the same pixels, labels and samples, batch by batch, in two epochs."""
    import torch

    from benchmarks.peers import loader_transform, own_transform
    from shardloader import Dataset, Loader

    def batches(transform, field):
        loader = Loader(Dataset(jpeg_dataset.path), batch_size=8, num_workers=0, seed=11,
                        transform=transform, shuffle=True, tail="partial")
        out = []
        for _ in range(2):
            out += [(b[field], b["label"], b["__index__"]) for b in loader]
        return out

    readme, own = batches(loader_transform("readme"), "image"), batches(own_transform, "img")
    assert len(readme) == len(own) == 10  # 40 samples, 5 batches an epoch
    for (a_img, a_label, a_index), (b_img, b_label, b_index) in zip(readme, own):
        assert torch.equal(a_index, b_index) and torch.equal(a_label, b_label)
        assert torch.equal(a_img, b_img)
    assert not torch.equal(readme[0][0], readme[5][0])  # epochs differ: the key has the epoch


def test_the_own_function_ratio_is_per_round_and_checks_the_goal():
    """Own-function epochs 5,600 and 7,000 after README epochs 7,000 and 7,200: ratios 0.80,
    0.97 (median 0.885, goal missed); DataLoader's own over its fast path. From CPU per sample
    (README's over own's, per round): 380/500 and 400/400 us, median 0.88."""
    raw = _raw({"rates": {f"{OURS}|readme": [7000.0, 7200.0], f"{OURS}|own": [5600.0, 7000.0],
                          "torch DataLoader|own": [4000.0], "torch DataLoader|fast": [5000.0]},
                "epoch_cpu": {f"{OURS}|readme": [380e-6, 400e-6], f"{OURS}|own": [500e-6, 400e-6]}})
    raw["columns"] = [OURS, "torch DataLoader"]
    by_name = {f.name.strip(): f for f in figures(raw)}
    readme = by_name["samples/s, README transform Compose([DecodeCropFlip(112), ToTensor()])"]
    assert readme.values == {OURS: 7100.0}
    own = next(f for name, f in by_name.items() if name.startswith("samples/s, the same built-in"))
    assert own.values == {OURS: 6300.0, "torch DataLoader": 4000.0} and own.met() == "no"
    ratio = next(f for name, f in by_name.items() if name.startswith("own function ÷ README"))
    assert ratio.values[OURS] == pytest.approx((0.8 + 7000 / 7200) / 2)
    assert ratio.values["torch DataLoader"] == pytest.approx(0.8)
    assert ratio.met() == "no"
    by_cpu = next(f for name, f in by_name.items() if name.startswith("the same from CPU"))
    assert by_cpu.values == {OURS: pytest.approx((0.76 + 1.0) / 2)} and by_cpu.met() == "no"
    assert by_cpu.why == {"torch DataLoader": "not measured"}
    raw["in_process"]["rates"][f"{OURS}|own"] = [6900.0, 7000.0]
    by_name = {f.name.strip(): f for f in figures(raw)}
    own = next(f for name, f in by_name.items() if name.startswith("samples/s, the same built-in"))
    assert own.met() == "yes"


def test_spdl_has_na_cells_with_reasons_where_it_has_no_such_figure():
    """SPDL reads local files with its own decoder: its cold-start and PIL cells say so (n/a
    with the reason under the table), and it has no README/own-function cells at all."""
    raw = _raw({"rates": {f"{OURS}|fast": [1.0], "SPDL|fast": [1.0]}})
    raw["columns"] = [OURS, "SPDL"]
    text = render(figures(raw), raw["columns"])
    cold = next(line for line in text.splitlines() if line.startswith("| first batch, cold"))
    assert [c.strip() for c in cold.strip("|").split("|")][2] == "n/a"
    assert "- SPDL (first batch, cold from S3" in text and "no S3 reader" in text
    assert "its own FFmpeg decoder only" in text
    own = next(line for line in text.splitlines() if line.startswith("| samples/s, the same built"))
    assert [c.strip() for c in own.strip("|").split("|")][2] == "-"
