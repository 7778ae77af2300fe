"""The transform protocol, composition, versions, and the shared helpers of the transforms.

A transform is a callable `transform(sample: dict) -> dict`. One whose signature has a
`generator` keyword receives the sample's `torch.Generator` (the Loader keys it by seed, epoch
and sample index, invariant I3) and must draw all its randomness from it, so that an augmented
sample is a pure function of that key. With `generator=None` the random transforms fall back to
torch's global generator (which the Loader also seeds per sample).

Transforms return a new dict (a shallow copy with the changed field) and never mutate the
sample they were given, so a sample can be transformed twice with the same result.

Every transform here has a `version` string: its class, its parameters, and an implementation
number (`impl`) that is bumped whenever the same parameters would produce different bytes.
`transform_version(t)` turns any transform, `Compose` or plain function into such a string, for
the Loader's fingerprint (I5): a resume with a different augmentation pipeline is refused.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from shardloader.errors import ShardloaderError

Sample = dict[str, Any]


class TransformError(ShardloaderError, ValueError):
    """A transform got a sample it cannot work on (missing field, wrong type or shape)."""


def describe_sample(sample: Mapping[str, Any]) -> str:
    """`sample __index__=12 (__key__='a/b')`, or `sample` when it carries neither."""
    parts = []
    if "__index__" in sample:
        parts.append(f"__index__={sample['__index__']!r}")
    if "__key__" in sample:
        parts.append(f"__key__={sample['__key__']!r}")
    return "sample " + " ".join(parts) if parts else "sample"


def get_field(sample: Mapping[str, Any], field: str, who: str) -> Any:
    """`sample[field]`, or a TransformError that names the transform, field and sample."""
    try:
        return sample[field]
    except KeyError:
        fields = ", ".join(sorted(repr(k) for k in sample)) or "none"
        raise TransformError(
            f"{who}: {describe_sample(sample)} has no field {field!r} (fields: {fields})"
        ) from None
    except TypeError:
        raise TransformError(
            f"{who}: expected a sample dict, got {type(sample).__name__}"
        ) from None


def with_field(sample: Mapping[str, Any], field: str, value: Any) -> Sample:
    """A shallow copy of `sample` with `field` set to `value`."""
    out = dict(sample)
    out[field] = value
    return out


def accepts_generator(transform: Callable[..., Any]) -> bool:
    """True if `transform` has a parameter named `generator` that can be passed by keyword.

    The one rule for every caller: the Loader for its `transform`, `Compose` for each member,
    `Lambda` for its function, so a callable draws the same whether it runs alone or inside a
    `Compose`. A bare `**kwargs` does not count: a function must ask for the generator by name
    (one that does not draws from the global RNGs, which the Loader seeds per sample from the
    same key). Call it once per transform (at construction), not per sample:
    `inspect.signature` is slow.
    """
    try:
        params = inspect.signature(transform).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    param = params.get("generator")
    return param is not None and param.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


class Transform:
    """Base class: a named, parameterised, versioned `sample -> sample` function.

    Subclasses set `impl` (bump it when the output for the same parameters changes) and
    implement `__call__` and `params()`.
    """

    impl: int = 1
    # Whether the transform may draw from the global RNGs (random, numpy.random, torch's)
    # when it is given a generator. shardloader's transforms draw only from the generator, so
    # the Loader need not seed the global RNGs for them per sample (that costs ~30 us/sample).
    uses_global_rng: bool = False

    def params(self) -> dict[str, Any]:
        """The parameters that define the output, in a stable order (for `version`/repr)."""
        return {}

    @property
    def version(self) -> str:
        args = ", ".join(f"{k}={_stable_repr(v)}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})#impl{self.impl}"

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_stable_repr(v)}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def __call__(self, sample: Sample) -> Sample:  # pragma: no cover - abstract
        raise NotImplementedError


class Compose(Transform):
    """Apply `transforms` in order; pass `generator` to each member that accepts it.

    All members share the one generator, in order, so the draws of a member depend on the
    draws of the members before it (as with one stream); the whole chain stays a pure function
    of the generator's seed.
    """

    def __init__(self, transforms: Iterable[Callable[..., Any]]) -> None:
        self.transforms = list(transforms)
        for i, t in enumerate(self.transforms):
            if not callable(t):
                raise TypeError(f"Compose: member {i} is not callable: {t!r}")
        self._members = [(t, accepts_generator(t)) for t in self.transforms]

    def __call__(self, sample: Sample, generator: Any = None) -> Sample:
        for t, takes in self._members:
            sample = t(sample, generator=generator) if takes else t(sample)
        return sample

    @property
    def uses_global_rng(self) -> bool:  # type: ignore[override]
        """True if any member may draw from the global RNGs (plain functions are assumed to)."""
        return any(getattr(t, "uses_global_rng", True) for t in self.transforms)

    def params(self) -> dict[str, Any]:
        return {"transforms": self.transforms}

    @property
    def version(self) -> str:
        return "Compose[" + ", ".join(transform_version(t) for t in self.transforms) + "]"

    def __repr__(self) -> str:
        inner = "".join(f"\n    {t!r}," for t in self.transforms)
        return f"Compose([{inner}\n])"

    def __getstate__(self) -> dict[str, Any]:
        return {"transforms": self.transforms}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["transforms"])  # type: ignore[misc]


class Lambda(Transform):
    """Wrap a function `fn(sample) -> sample` (or `fn(sample, generator=...)`) as a transform.

    A function's code is not part of its version: pass `version="..."` and change it when the
    function's output changes, or a resume may silently mix old and new augmentations.
    """

    uses_global_rng = True  # the wrapped function may use random/numpy/torch global RNGs

    def __init__(self, fn: Callable[..., Any], *, version: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"Lambda: {fn!r} is not callable")
        self.fn = fn
        self.user_version = version
        self._takes_generator = accepts_generator(fn)

    def __call__(self, sample: Sample, generator: Any = None) -> Sample:
        if self._takes_generator:
            return self.fn(sample, generator=generator)
        return self.fn(sample)

    def params(self) -> dict[str, Any]:
        return {"fn": _callable_name(self.fn), "version": self.user_version}

    def __getstate__(self) -> dict[str, Any]:
        return {"fn": self.fn, "user_version": self.user_version}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["fn"], version=state["user_version"])  # type: ignore[misc]


def transform_version(transform: Any, *, libraries: bool = False) -> str:
    """A string that changes when `transform` would produce different output.

    Uses the `version` attribute when there is one (all shardloader transforms, `Compose`
    recursively: their class, constructor parameters and implementation number), else the
    qualified name of a function, or for another callable object (a torchvision transform) its
    class and its own repr when that repr shows its parameters. The Loader puts this string in
    its fingerprint, so a resume with another augmentation is refused. With `libraries=True` the
    versions of the image libraries are appended (their resize/decode bits can change between
    releases; off by default so that a routine upgrade does not block a resume).
    """
    if isinstance(transform, (list, tuple)):
        text = "[" + ", ".join(transform_version(t) for t in transform) + "]"
    elif transform is None:
        text = "None"
    else:
        version = getattr(transform, "version", None)
        if isinstance(version, str):
            text = version
        elif version is not None and not callable(version):
            text = f"{_callable_name(transform)}@{version}"
        else:
            text = _callable_name(transform) + _own_repr(transform)
    if libraries:
        text += " | " + library_versions()
    return text


def library_versions() -> str:
    """`opencv=4.x simplejpeg=1.x pillow=1x.x torch=2.x` (the libraries whose bits we use)."""
    import cv2
    import PIL
    import simplejpeg
    import torch

    return (
        f"opencv={cv2.__version__} simplejpeg={simplejpeg.__version__} "
        f"pillow={PIL.__version__} torch={torch.__version__}"
    )


def _callable_name(obj: Any) -> str:
    if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isbuiltin(obj):
        return f"{obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, functools.partial):
        args = ", ".join([_stable_repr(a) for a in obj.args] + [f"{k}={_stable_repr(v)}" for k, v in obj.keywords.items()])
        return f"partial({_callable_name(obj.func)}, {args})"
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _own_repr(obj: Any) -> str:
    """` = <repr>` for an object (not a function) whose class defines a repr without memory
    addresses, e.g. torchvision's `RandomResizedCrop(size=(224, 224), ...)`; else ''."""
    if inspect.isroutine(obj) or isinstance(obj, (functools.partial, type)):
        return ""
    if type(obj).__repr__ is object.__repr__:
        return ""
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a broken repr only loses detail
        return ""
    return "" if " at 0x" in text else f" = {text}"


def _stable_repr(value: Any) -> str:
    """repr() without memory addresses (they differ between processes and runs)."""
    if isinstance(value, Transform):
        return value.version
    if isinstance(value, float):
        return repr(round(value, 12))
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_stable_repr(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if callable(value) and not isinstance(value, type):
        return _callable_name(value)
    text = repr(value)
    return _callable_name(value) if " at 0x" in text else text


# -- OpenCV threads --------------------------------------------------------------------------
# Loader workers already run one sample per core; OpenCV's own thread pool would start another
# pool per worker process and oversubscribe the cores (on 2 cores with 2 workers: 2 x 2 threads
# fighting over 2 cores), and a 112 px resize is far too small to gain from threads anyway. So
# the transforms set OpenCV to one thread the first time each process uses it. Change with
# `set_opencv_threads(n)`, or `set_opencv_threads(None)` to leave OpenCV's setting alone.

_opencv_threads: int | None = 1
_opencv_configured = False  # in this process; a forked child starts unconfigured


def _unconfigure_opencv_in_child() -> None:
    global _opencv_configured
    _opencv_configured = False


os.register_at_fork(after_in_child=_unconfigure_opencv_in_child)


def set_opencv_threads(threads: int | None) -> None:
    """Threads OpenCV may use inside transforms (default 1; None: do not touch OpenCV)."""
    global _opencv_threads, _opencv_configured
    _opencv_threads = threads
    _opencv_configured = False


def opencv() -> Any:
    """The `cv2` module, configured for per-sample work in this process. (A flag reset at fork,
    not a pid comparison: this runs several times per sample, and `os.getpid()` per call cost
    ~1.5% of a worker's time in a profile.)"""
    global _opencv_configured
    import cv2

    if not _opencv_configured:
        if _opencv_threads is not None:
            cv2.setNumThreads(_opencv_threads)
        _opencv_configured = True
    return cv2
