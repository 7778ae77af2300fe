"""Mixtures of datasets: the pure order (interleave, passes, weight changes) and the dataset.

The Loader-level tests (kill and resume, worker and world-size changes) are in
tests/test_mixture_loader.py."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import shardloader
from shardloader.order.interleave import event_time, interleave, normalized, position_of_draw
from shardloader.order.mixture import MixtureOrder, pass_length

SEED = 11


def _reference(weights: list[float], count: int) -> list[int]:
    """The interleave by brute force: every draw's time, sorted by (time, source)."""
    w = normalized(weights)
    events = [(float(event_time(np.array([k]), w[i:i + 1])[0]), i)
              for i in range(len(w)) if w[i] > 0 for k in range(count + 2)]
    return [source for _, source in sorted(events)[:count]]


WEIGHT_SETS = [[0.7, 0.3], [1, 1], [1, 2, 3], [0.5, 0.25, 0.25], [3, 0, 1], [0.05, 0.95],
               [1, 1, 1, 1], [0.1, 0.2, 0.3, 0.15, 0.25], [1e-3, 1]]


@pytest.mark.parametrize("weights", WEIGHT_SETS)
def test_interleave_is_the_sorted_stride_schedule(weights):
    count = 400
    expected = _reference(weights, count)
    counts, source = interleave(np.array(weights, dtype=float), np.arange(count))
    assert source.tolist() == expected
    running = np.zeros(len(weights), dtype=np.int64)
    for p in range(count):
        assert counts[p].tolist() == running.tolist()
        running[expected[p]] += 1
    for i, w in enumerate(weights):
        if w > 0:
            ks = [p for p, s in enumerate(expected) if s == i][:4]
            assert [position_of_draw(np.array(weights, dtype=float), i, k) for k in range(len(ks))] == ks


@pytest.mark.parametrize("sources", [2, 3])
def test_counts_over_any_prefix_are_within_one_of_the_weights_share(sources):
    rng = np.random.default_rng(sources)
    for _ in range(30):
        w = normalized(rng.random(sources) + 0.01)
        counts, _ = interleave(w, np.arange(3000))
        share = np.arange(3000)[:, None] * w[None, :]
        assert np.abs(counts - share).max() < 1


def test_counts_stay_within_the_documented_bound_for_many_sources():
    rng = np.random.default_rng(5)
    for s in (4, 6, 10):
        w = normalized(rng.random(s) ** 3 + 0.001)
        counts, _ = interleave(w, np.arange(4000))
        deviation = np.abs(counts - np.arange(4000)[:, None] * w[None, :])
        assert np.all(deviation <= 0.5 + (s - 1) * w[None, :] / 2 + 1e-9)


def test_interleave_far_into_a_run_matches_its_neighbourhood():
    """Positions near 10^12: the window and the counts before it still agree with the draws
    of consecutive positions (each position draws one source, counts grow by one)."""
    w = np.array([0.7, 0.2, 0.1])
    q = np.arange(10**12, 10**12 + 200)
    counts, source = interleave(w, q)
    assert np.array_equal(counts[1:] - counts[:-1], np.eye(3, dtype=np.int64)[source[:-1]])
    assert np.abs(counts - q[:, None] * w[None, :]).max() < 1


def _order(sizes, weights, length, names=None, shuffle=True):
    names = names or [f"s{i}" for i in range(len(sizes))]
    return MixtureOrder(names, sizes, weights, length, shuffle=shuffle, identity="test")


def _draws_by_source(order, epochs, seed=SEED):
    """Each source's local samples in draw order over `epochs` whole epochs."""
    out = {i: [] for i in range(len(order.sizes))}
    for epoch in range(epochs):
        samples = order.samples_at(seed, epoch, np.arange(len(order)))
        which = np.searchsorted(order.offsets, samples, side="right") - 1
        for i in out:
            out[i].extend((samples[which == i] - order.offsets[i]).tolist())
    return out


def test_every_sample_of_a_source_once_per_pass_small_sources_repeat():
    order = _order([7, 50, 300], [0.4, 0.4, 0.2], 120)
    draws = _draws_by_source(order, epochs=5)
    for i, n in enumerate(order.sizes.tolist()):
        seq = draws[i]
        full = len(seq) // n
        assert full >= (1 if n < 300 else 0)
        passes = [seq[k * n:(k + 1) * n] for k in range(full)]
        for p in passes:
            assert sorted(p) == list(range(n))
        rest = seq[full * n:]
        assert len(set(rest)) == len(rest)
        if len(passes) >= 2:
            assert passes[0] != passes[1]  # each pass newly permuted
    assert len(draws[0]) > 7 * 10  # the small source repeated ten times and more
    assert len(draws[2]) < 300  # the large one has not finished its first pass: no repeat


def test_without_shuffle_each_pass_is_in_sample_order():
    order = _order([5, 9], [0.5, 0.5], 14, shuffle=False)
    draws = _draws_by_source(order, epochs=3)
    assert draws[0] == list(range(5)) * 4 + list(range(len(draws[0]) - 20))
    assert draws[1][:9] == list(range(9))


def test_an_epoch_of_one_pass_of_a_named_source():
    names, sizes, weights = ["web", "curated"], [1000, 40], [0.8, 0.2]
    length = pass_length(names, sizes, weights, "curated")
    order = _order(sizes, weights, length, names=names)
    for epoch in range(3):
        samples = order.samples_at(SEED, epoch, np.arange(length))
        curated = samples[samples >= 1000] - 1000
        assert sorted(curated.tolist()) == list(range(40))  # exactly one pass per epoch
    assert samples[-1] >= 1000  # the epoch ends with the pass's last draw
    with pytest.raises(ValueError, match="epoch='nope'"):
        pass_length(names, sizes, weights, "nope")


@pytest.mark.parametrize("history", [False, True])
def test_samples_at_is_the_same_for_any_set_of_positions(history):
    order = _order([13, 200, 31], [0.5, 0.3, 0.2], 150)
    if history:  # weights changed in epoch 1 and again in epoch 2
        state = order.order_state(1, 60)
        order = _order([13, 200, 31], [0.1, 0.1, 0.8], 150)
        order.load_order_state(state, 1, 60)
        state = order.order_state(2, 30)
        order = _order([13, 200, 31], [1, 1, 1], 150)
        order.load_order_state(state, 2, 30)
        with pytest.raises(ValueError, match="before this order's history, which starts at epoch 1"):
            order.samples_at(SEED, 1, np.arange(150))
    rng = np.random.default_rng(3)
    for epoch in range(2 if history else 0, 5):
        every = order.samples_at(SEED, epoch, np.arange(150))
        one_by_one = [int(order.samples_at(SEED, epoch, np.array([p]))[0]) for p in range(150)]
        assert every.tolist() == one_by_one
        picked = rng.choice(150, size=40, replace=False)
        assert order.samples_at(SEED, epoch, picked).tolist() == every[picked].tolist()
        assert order.samples_at(SEED, epoch, picked.reshape(5, 8)).tolist() == every[picked].reshape(5, 8).tolist()
    assert not np.array_equal(order.samples_at(SEED, 4, np.arange(150)), order.samples_at(SEED + 1, 4, np.arange(150)))


def _consumed_this_pass(order, upto_epoch, upto_position):
    """Per source: its draws since its current pass began, read before (epoch, position)."""
    seen = {i: [] for i in range(len(order.sizes))}
    for epoch in range(upto_epoch + 1):
        end = upto_position if epoch == upto_epoch else len(order)
        samples = order.samples_at(SEED, epoch, np.arange(end))
        which = np.searchsorted(order.offsets, samples, side="right") - 1
        for i in seen:
            seen[i].extend((samples[which == i] - order.offsets[i]).tolist())
    return {i: s[len(s) - len(s) % int(order.sizes[i]):] for i, s in seen.items()}


@pytest.mark.parametrize("new_weights", [[0.1, 0.1, 0.8], [0.0, 0.5, 0.5], [0.9, 0.05, 0.05]])
def test_weights_changed_at_a_resume_read_nothing_of_the_current_pass_twice(new_weights):
    sizes, length = [40, 500, 90], 200
    old = _order(sizes, [0.3, 0.5, 0.2], length)
    epoch, position = 1, 128
    state = json.loads(json.dumps(old.order_state(epoch, position)))  # a plain dict
    before = _consumed_this_pass(old, epoch, position)
    assert [state["sources"][f"s{i}"]["in_pass"] for i in range(3)] == [len(before[i]) for i in range(3)]
    new = _order(sizes, new_weights, length)
    new.load_order_state(state, epoch, position)
    # The rest of epoch 1 and the next epoch, read with the new weights.
    after = {i: [] for i in range(3)}
    for e, start in ((epoch, position), (epoch + 1, 0)):
        samples = new.samples_at(SEED, e, np.arange(start, length))
        which = np.searchsorted(new.offsets, samples, side="right") - 1
        for i in after:
            after[i].extend((samples[which == i] - new.offsets[i]).tolist())
    reread = 0
    for i, n in enumerate(sizes):
        rest_of_pass = after[i][:n - len(before[i])]  # what the current pass still had to give
        reread += len(set(before[i]) & set(rest_of_pass))
        assert len(set(rest_of_pass)) == len(rest_of_pass)
        if len(after[i]) >= n - len(before[i]):  # the pass ended: it held every sample once
            assert sorted(before[i] + rest_of_pass) == list(range(n))
    assert reread == 0
    # Positions before the change still read what the old weights read (the history).
    assert np.array_equal(new.samples_at(SEED, epoch, np.arange(position)),
                          old.samples_at(SEED, epoch, np.arange(position)))
    # The new weights hold after the change: counts over the rest follow them.
    counts = Counter(np.searchsorted(new.offsets, new.samples_at(SEED, epoch + 1, np.arange(length)),
                                     side="right") - 1)
    for i, w in enumerate(normalized(new_weights)):
        assert abs(counts.get(i, 0) - w * length) < 1


def test_an_added_source_starts_its_first_pass_and_the_others_continue():
    old = MixtureOrder(["a", "b"], [30, 70], [0.5, 0.5], 100, identity="x")
    state = old.order_state(0, 64)
    before = _consumed_this_pass(old, 0, 64)
    new = MixtureOrder(["a", "b", "c"], [30, 70, 20], [0.4, 0.4, 0.2], 100, identity="y")
    new.load_order_state(state, 0, 64)
    draws = new.draws_before(0, 64)
    assert draws == {"a": state["sources"]["a"]["draws"], "b": state["sources"]["b"]["draws"], "c": 0}
    rest = new.samples_at(SEED, 0, np.arange(64, 100))
    in_pass = state["sources"]["a"]["in_pass"]
    a = [x for x in rest.tolist() if x < 30][:30 - in_pass]
    assert not set(a) & set(before[0]) and len(set(a)) == len(a)
    c = [x - 100 for x in rest.tolist() if x >= 100]
    assert c and len(set(c)) == len(c) and all(0 <= x < 20 for x in c)


def test_unchanged_weights_resume_exactly_and_state_stays_small():
    order = _order([13, 200], [0.6, 0.4], 90)
    state = order.order_state(3, 45)
    assert len(state["segments"]) == 1
    again = _order([13, 200], [0.6, 0.4], 90)
    again.load_order_state(state, 3, 45)
    assert len(again.segments) == 1
    for epoch in (3, 4):
        assert np.array_equal(again.samples_at(SEED, epoch, np.arange(90)), order.samples_at(SEED, epoch, np.arange(90)))
    changed = _order([13, 200], [0.2, 0.8], 90)
    changed.load_order_state(state, 3, 45)
    later = changed.order_state(5, 10)  # two epochs on: only the segment in effect is kept
    assert len(later["segments"]) == 1 and later["segments"][0]["weights"] == {"s0": 0.2, "s1": 0.8}
    resumed = _order([13, 200], [0.2, 0.8], 90)
    resumed.load_order_state(later, 5, 10)
    assert np.array_equal(resumed.samples_at(SEED, 5, np.arange(90)), changed.samples_at(SEED, 5, np.arange(90)))


def test_a_state_that_does_not_fit_is_refused_naming_the_source():
    state = _order([13, 200], [0.6, 0.4], 90).order_state(0, 10)
    with pytest.raises(ValueError, match="^mixture source 's1': the saved state has 200 samples"):
        _order([13, 201], [0.6, 0.4], 90).load_order_state(state, 0, 10)
    with pytest.raises(ValueError, match="^mixture source 's1': in the saved state but not in this mixture"):
        MixtureOrder(["s0"], [13], [1.0], 90).load_order_state(state, 0, 10)


# -- the dataset ------------------------------------------------------------------------------
class Squares:
    """A map-style source with other fields than the Arrow one's."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"value": i * i}


def _as_label(record: dict) -> dict:
    return {"label": record["value"] % 10, "__index__": -1}


def test_a_mixture_reads_each_source_once_per_batch_with_its_transform(arrow_dataset):
    arrow = shardloader.Dataset(arrow_dataset.path)
    mix = shardloader.Mixture({"arrow": (arrow, 0.7),
                               "squares": shardloader.MixtureSource(Squares(30), 0.3, _as_label)})
    assert len(mix) == 230
    calls = []
    get_many = arrow.get_many
    arrow.get_many = lambda samples: calls.append(list(samples)) or get_many(samples)
    records = mix.get_many([5, 210, 7, 200, 3])
    assert calls == [[5, 7, 3]]
    assert [r["__index__"] for r in records] == [5, 210, 7, 200, 3]
    assert records[0]["label"] == arrow_dataset.samples[5]["label"]
    assert records[1]["label"] == (10 * 10) % 10 and records[3]["label"] == 0
    assert mix[210]["__index__"] == 210 and mix[-1]["__index__"] == 229
    with pytest.raises(IndexError, match="230"):
        mix[230]


def test_the_fingerprint_names_sources_and_lengths_not_weights(arrow_dataset):
    arrow = shardloader.Dataset(arrow_dataset.path)
    a = shardloader.Mixture({"arrow": (arrow, 0.7), "squares": (Squares(30), 0.3)})
    b = shardloader.Mixture({"arrow": (arrow, 0.1), "squares": (Squares(30), 0.9)})
    c = shardloader.Mixture({"arrow": (arrow, 0.7), "squares": (Squares(31), 0.3)})
    assert a.index.fingerprint == b.index.fingerprint != c.index.fingerprint
    assert a.epoch_sampler(True).fingerprint == b.epoch_sampler(True).fingerprint
    assert a.epoch_sampler(True).fingerprint != c.epoch_sampler(True).fingerprint


def test_epoch_lengths_and_bad_arguments():
    mix = shardloader.Mixture({"a": (Squares(10), 1), "b": (Squares(90), 1)})
    assert len(mix.epoch_sampler(True)) == 100
    assert len(shardloader.Mixture({"a": (Squares(10), 1), "b": (Squares(90), 1)}, epoch=7).epoch_sampler(True)) == 7
    one_pass = shardloader.Mixture({"a": (Squares(10), 1), "b": (Squares(90), 1)}, epoch="a")
    assert len(one_pass.epoch_sampler(True)) == 19  # a, b, a, b, ..., a: a's 10th draw
    with pytest.raises(ValueError, match="^Mixture source 'a': weight must be a number >= 0"):
        shardloader.Mixture({"a": (Squares(10), -1)})
    with pytest.raises(ValueError, match="^Mixture source 'a': the dataset is empty"):
        shardloader.Mixture({"a": Squares(0), "b": Squares(3)})
    with pytest.raises(TypeError, match="^Mixture source 'a': Loader needs a map-style dataset"):
        shardloader.Mixture({"a": object()})
    with pytest.raises(ValueError, match="^epoch='c': no source of that name"):
        shardloader.Mixture({"a": Squares(3), "b": Squares(3)}, epoch="c")
