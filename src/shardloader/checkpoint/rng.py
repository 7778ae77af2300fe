"""Global random generator states of python, numpy, torch CPU and every CUDA device.

`capture()` returns a small plain dict (JSON-able, no pickle) and `restore()` puts every
generator back exactly, so the next `random.random()`, `np.random.rand()`, `torch.rand()` and
CUDA draw after a load are the ones the uninterrupted run would have produced.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from shardloader.errors import StateError

VERSION = 1


def capture() -> dict[str, Any]:
    """The current state of every global generator, as a plain dict."""
    py_version, py_internal, py_gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "version": VERSION,
        "python": {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
        "numpy": {
            "bit_generator": name,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": _b64(torch.get_rng_state()),
        "cuda": [],
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict[str, Any], *, source: str) -> None:
    """Set every global generator to `state` (from `capture`). `source` names it in errors."""
    py_state, np_state, torch_state, cuda_states = parse(state, source=source)
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)
    if cuda_states:
        if not torch.cuda.is_available():
            raise StateError(
                f"{source}: the checkpoint holds RNG states for {len(cuda_states)} CUDA devices "
                "but CUDA is not available here"
            )
        n = torch.cuda.device_count()
        for device, s in enumerate(cuda_states[:n]):
            torch.cuda.set_rng_state(s, device)


def parse(state: Any, *, source: str) -> tuple[Any, Any, torch.Tensor, list[torch.Tensor]]:
    """Validate a captured state: (python, numpy, torch, cuda states); StateError if malformed."""
    try:
        if state["version"] != VERSION:
            raise StateError(f"{source}: RNG state version {state['version']} is not {VERSION}")
        py = state["python"]
        npy = state["numpy"]
        py_state = (py["version"], tuple(int(x) for x in py["internal"]), py["gauss_next"])
        np_state = (
            npy["bit_generator"],
            np.asarray(npy["keys"], dtype=np.uint32),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached_gaussian"]),
        )
        torch_state = _unb64(state["torch"])
        cuda_states = [_unb64(s) for s in state["cuda"]]
        if len(py_state[1]) != len(random.getstate()[1]) or len(np_state[1]) != 624:
            raise ValueError("generator state has the wrong length")
        if torch_state.numel() != torch.get_rng_state().numel():
            raise ValueError(f"torch generator state has {torch_state.numel()} bytes")
    except (KeyError, TypeError, ValueError) as exc:
        raise StateError(f"{source}: malformed RNG state ({type(exc).__name__}: {exc})") from None
    return py_state, np_state, torch_state, cuda_states


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)
