"""Type checks for numbers read from checkpoint bytes, and for the step a caller passes.

A checkpoint may come from anyone (`untrusted`), so a size, an offset or a shape read from a
manifest, a tensor file header or DCP's metadata is used only once it is exactly what it claims
to be: an int (a JSON `true` parses as a Python bool, which is an int, and is refused), not
negative. One check for the package, so every reader refuses the same values.
"""

from __future__ import annotations


def is_nonneg_int(value: object) -> bool:
    """True for an int >= 0 that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
