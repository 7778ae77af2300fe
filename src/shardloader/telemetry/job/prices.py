"""Prices: turn a job report's seconds, bytes and requests into money.

`--prices gpu_hour=2.5,gpus=8,egress_gb=0.09,get_1k=0.0004,put_1k=0.005` is parsed by
`parse_prices`; `cost(report, prices)` prices every kind of accounted second (so the report can
say what each kind of badput cost), the bytes read from remote storage, and the requests. The
currency is whatever the prices are in: nothing here converts or assumes one.

Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: The price keys and what each one is the price of.
PRICE_KEYS: dict[str, str] = {
    "gpu_hour": "one accelerator for one hour",
    "gpus": "accelerators the job holds (default: the largest attempt's rank count)",
    "egress_gb": "one GB (1e9 bytes) read from remote storage",
    "get_1k": "1000 read requests (whole-shard downloads and ranged GETs)",
    "put_1k": "1000 written files (checkpoint files)",
}

#: The accounted kinds of seconds, as in the report's "seconds".
SECOND_KINDS = (
    "productive",
    "data_wait",
    "checkpoint",
    "restore",
    "startup",
    "lost_progress",
    "between_attempts",
    "other",
)


def _price(key: str, value: Any) -> float:
    """`value` as a finite, non-negative price for `key`, else a ValueError naming `key`."""
    if key not in PRICE_KEYS:
        known = ", ".join(PRICE_KEYS)
        raise ValueError(f"unknown price {key!r} (known: {known})")
    if isinstance(value, bool):
        raise ValueError(f"price {key!r}: not a number: {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"price {key!r}: not a number: {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"price {key!r}: not a finite number: {value!r}")
    if number < 0:
        raise ValueError(f"price {key!r}: negative: {value!r}")
    if key == "gpus" and number == 0:
        raise ValueError("price 'gpus': must be more than 0")
    return number


def parse_prices(text: str) -> dict[str, float]:
    """`"gpu_hour=2.5,gpus=8"` -> `{"gpu_hour": 2.5, "gpus": 8.0}`: only the keys given.

    Keys are those of `PRICE_KEYS`; an unknown key, a repeated key, an item without `=`, a value
    that is not a finite number, or a negative one is a ValueError that names it. Keys left out
    are priced by `cost` as 0 (and `gpus` as the job's largest attempt).
    """
    prices: dict[str, float] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ValueError(f"price {item!r}: expected key=value")
        if key in prices:
            raise ValueError(f"price {key!r}: given twice")
        prices[key] = _price(key, value)
    return prices


def _gpus(report: Mapping[str, Any]) -> float:
    """The default accelerator count: the largest attempt's number of ranks (1 if none)."""
    ranks = [int(a["ranks"]) for a in report.get("attempts") or ()]
    return float(max(ranks, default=1) or 1)


def cost(report: Mapping[str, Any], prices: Mapping[str, Any]) -> dict[str, Any]:
    """The money of a job report (`account`'s object) at `prices` (as from `parse_prices`).

    compute[kind] = gpu_hour * gpus * seconds[kind] / 3600 for every kind of seconds; badput is
    the compute money of every kind but productive; egress = remote bytes / 1e9 * egress_gb;
    requests = (downloads + ranged GETs) / 1000 * get_1k + checkpoint files / 1000 * put_1k.
    """
    used = {key: _price(key, value) for key, value in prices.items()}
    used.setdefault("gpus", _gpus(report))
    for key in PRICE_KEYS:
        used.setdefault(key, 0.0)
    rate = used["gpu_hour"] * used["gpus"] / 3600
    seconds = report["seconds"]
    compute = {kind: rate * float(seconds[kind]) for kind in SECOND_KINDS}
    badput = sum(money for kind, money in compute.items() if kind != "productive")
    egress = float(report["bytes"]["remote_read"]) / 1e9 * used["egress_gb"]
    req = report["requests"]
    gets = int(req["shard_downloads"]) + int(req["range_requests"])
    requests = gets / 1000 * used["get_1k"] + int(req["checkpoint_files"]) / 1000 * used["put_1k"]
    return {
        "currency_note": "in the units of the given prices",
        "total": sum(compute.values()) + egress + requests,
        "compute": compute,
        "badput": badput,
        "egress": egress,
        "requests": requests,
        "prices": {key: used[key] for key in PRICE_KEYS},
    }
