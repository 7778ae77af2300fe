"""Seeding the global RNGs per sample only where a transform draws from them, exactly.

A transform that does not declare `uses_global_rng = False` may draw from `random`, legacy
`numpy.random` or torch's default generator, and I3 says those draws, for sample g in epoch e,
are the ones the generators give right after being seeded from the sample's key. Seeding all
three before every sample (`GlobalRngScope`) costs 20-25 us per sample in a worker, most of
it `random.seed` and `np.random.seed` (MT19937 initialisation): a user's own function paid it
even when it drew only from the `generator` it was given.

The figure it earns its place with (issue 37; 2 shared cores): in a tight loop eager seeding
costs 22.9 us a sample against this scope's 3.4 (`benchmarks/global_rngs.py`), but between
real samples (decode and random crop to 224 px of ImageNet-sized ~110 KB JPEGs, 1.8-2.0 ms
each; the generators' 5 kB of state no longer in the CPU's cache) it cost 54 us a sample more
than this scope (eager minus none: 65-74 us over 3 runs). Over 8 workers that is 0.9-1.2% of
a 50 ms step at batch 64 and 3.4-4.7% at batch 256: what a user whose workers are the
bottleneck sees as throughput. Eager seeding was built and measured (a branch that replaced
this module, same augmented bytes) and not taken for that figure.

`LazyGlobalRngScope` gives the same draws for less. Torch's CPU generator is seeded before
every sample, as before (1 us; reading its state would cost nearly as much, and seeding keeps
`torch.initial_seed()` right). `random` and `numpy` are not: each is left in a known state,
and after the sample a comparison of its raw state (read in place, below) says whether the
transform drew from it. If it did, the sample is run again with that generator seeded from
the key, and from then on that generator is seeded before every sample (the caller keeps
the set of such generators, so it holds for the rest of the process). A transform that never
draws from them never pays for them; one that draws pays one extra run, once per process.

Reading the state in place: MT19937 keeps 624 words and a position, and every draw moves the
position (after 624 words it regenerates all of them), so "the 625 words are unchanged" is
"nothing was drawn". For legacy numpy they are the bit generator's C state (its ctypes state
address); for `random`, the C object behind the module's functions (CPython's layout: the
position, then the words, after the object header). Each view is checked against the
generator's own `getstate()` once per process, after a seed and after a draw; where the check
fails (another interpreter, another layout) that generator is simply seeded eagerly. Cached
Gaussians are the one draw that moves no word (`random.gauss`'s `gauss_next`, legacy numpy's
second normal of a pair), so the scope clears both on entry by seeding the generators once.

What it cannot see: a transform that reads a global state without drawing from it
(`random.getstate()`, `np.random.get_state()`) or draws and then puts the state back. Such a
transform gets an unseeded state; docs/concepts.md says so.
"""

from __future__ import annotations

import ctypes
import random
import sys
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import numpy as np
import torch

_WORDS = 625  # MT19937: 624 state words and the position
T = TypeVar("T")


class StateWatch:
    """The raw words of one global MT19937 generator, read in place, and a snapshot of them."""

    def __init__(self, name: str, owner: object, view: np.ndarray) -> None:
        self.name = name
        self.owner = owner  # kept alive while viewed; compared to say the view still applies
        self._view = view
        self._snapshot = b""

    def snapshot(self) -> None:
        self._snapshot = self._view.tobytes()

    def moved(self) -> bool:
        """Whether the generator drew since `snapshot` (0.1-0.2 us)."""
        return self._view.tobytes() != self._snapshot


def _view_at(address: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint32 * _WORDS).from_address(address))


def _checked(view: np.ndarray, words: tuple[int, ...], position: int, position_first: bool) -> bool:
    """Whether `view` holds the generator's state as its own `getstate()` reports it."""
    got = [int(x) for x in view]
    if position_first:
        return got[0] == position and tuple(got[1:]) == words
    return got[-1] == position and tuple(got[:-1]) == words


def _python_watch() -> StateWatch | None:
    """A watch on the `random` module's generator, or None where its layout is not CPython's."""
    owner = getattr(random.random, "__self__", None)
    if sys.implementation.name != "cpython" or not isinstance(owner, random.Random):
        return None
    header = object.__basicsize__
    if type(owner).__basicsize__ < header + 4 * _WORDS:
        return None
    saved = owner.getstate()
    try:
        view = _view_at(id(owner) + header)
        for draw in (False, True):
            owner.seed(12345)
            if draw:
                owner.random()
            state = owner.getstate()[1]
            if not _checked(view, tuple(state[:-1]), state[-1], position_first=True):
                return None
    finally:
        owner.setstate(saved)
    return StateWatch("random", owner, view)


def _numpy_watch() -> StateWatch | None:
    """A watch on legacy `numpy.random`'s generator, or None where it cannot be read in place."""
    owner = getattr(np.random.mtrand, "_rand", None)
    bit_generator = getattr(owner, "_bit_generator", None)
    if type(bit_generator).__name__ != "MT19937":
        return None
    saved = owner.get_state()
    try:
        view = _view_at(bit_generator.ctypes.state_address)
        for draw in (False, True):
            np.random.seed(12345)
            if draw:
                np.random.random()
            _, words, position, _, _ = owner.get_state()
            if not _checked(view, tuple(int(w) for w in words), position, position_first=False):
                return None
    finally:
        owner.set_state(saved)
    return StateWatch("numpy", bit_generator, view)


_WATCHES: dict[str, StateWatch | None] = {}


def _watch(name: str) -> StateWatch | None:
    """This process's watch on `name` ("random" or "numpy"), made and checked once."""
    if name not in _WATCHES:
        _WATCHES[name] = _python_watch() if name == "random" else _numpy_watch()
    watch = _WATCHES[name]
    if watch is not None:
        current = (random.random.__self__ if name == "random"
                   else getattr(np.random.mtrand._rand, "_bit_generator", None))
        if current is not watch.owner:  # replaced since: not the generator the view reads
            return None
    return watch


def seed_python(key: int) -> None:
    random.seed(key)


def seed_numpy(key: int) -> None:
    np.random.seed([key & 0xFFFF_FFFF, key >> 32])  # legacy numpy: 32-bit words


def seed_torch(key: int) -> None:
    # The CPU generator is what `torch.manual_seed` seeds for CPU draws; calling it directly
    # skips torch.manual_seed's lazy seeding of absent accelerators, which formats a stack
    # trace on every call (~0.5 ms). CUDA's generators are seeded too when CUDA is in use.
    seed = key & 0x7FFF_FFFF_FFFF_FFFF
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


_SEEDERS = {"random": seed_python, "numpy": seed_numpy}

Streams = tuple[object, dict | tuple, torch.Tensor]


def save_streams() -> Streams:
    """The process's own states of the three global generators (what a scope restores)."""
    return random.getstate(), np.random.get_state(), torch.random.get_rng_state()


def restore_streams(streams: Streams) -> None:
    python, numpy_state, torch_state = streams
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.random.set_rng_state(torch_state)


class LazyGlobalRngScope:
    """Per-sample global seeding for one batch, `random` and `numpy` only where used.

    `eager` is the caller's set of generator names known to be drawn from (it grows: keep one
    per transform and process). Per sample: `seed(key)`, run the transform, then `moved()`;
    if that names generators, `promote` them and run the sample again after `seed(key)`.
    The process's own states are restored at exit, as `GlobalRngScope` does.
    """

    def __init__(self, eager: set[str]) -> None:
        self._eager = eager
        self._watches: list[StateWatch] = []

    def __enter__(self) -> LazyGlobalRngScope:
        self._streams = save_streams()
        for name, seeder in _SEEDERS.items():
            watch = None if name in self._eager else _watch(name)
            if watch is None:
                self._eager.add(name)
                continue
            seeder(0)  # a known state with no cached Gaussian (see the module doc)
            watch.snapshot()
            self._watches.append(watch)
        return self

    @property
    def watching(self) -> bool:
        """Whether some generator is left unseeded (then a sample may have to run again)."""
        return bool(self._watches)

    def seed(self, key: int) -> None:
        for name, seeder in _SEEDERS.items():
            if name in self._eager:
                seeder(key)
        seed_torch(key)

    def moved(self) -> list[str]:
        """The unseeded generators the last sample drew from."""
        return [w.name for w in self._watches if w.moved()]

    def promote(self, names: list[str]) -> None:
        """Seed `names` before every sample from now on, in this scope and the caller's."""
        self._eager.update(names)
        self._watches = [w for w in self._watches if w.name not in names]

    def run(self, key: int, sample: Callable[[bool], T]) -> T:
        """`sample(watching)` with the generators seeded for `key`, exactly as if all were:
        while a run drew from an unseeded generator, that generator is seeded from now on and
        the sample runs again (a seeded run can take a branch the unseeded one did not and
        draw from another one: hence a loop, at most one run more than there are generators).
        An exception counts only from a run that drew from no unseeded generator. `watching`
        tells the sample whether it may run again (then it must not change its input in
        place: the caller passes a copy)."""
        self.seed(key)
        while True:
            watching = self.watching
            failure: Exception | None = None
            try:
                result = sample(watching)
            except Exception as e:  # noqa: BLE001 - re-raised below unless the run was unseeded
                failure = e
            moved = self.moved() if watching else []
            if not moved:
                if failure is not None:
                    raise failure
                return result
            self.promote(moved)
            self.seed(key)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        restore_streams(self._streams)
