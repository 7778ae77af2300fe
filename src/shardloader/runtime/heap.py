"""Handing the C heap's free pages back to the kernel after a large, short-lived build."""

from __future__ import annotations


def trim_heap() -> bool:
    """Give the C heap's free pages back to the kernel (glibc's `malloc_trim`); whether it
    could. Called after building something large whose temporaries are gone (an index's
    columns, an epoch's order over 10^6 shards): glibc keeps freed pages for reuse, and in a
    process about to fork workers, those pages would be written by the workers' own
    allocations and so copied into each."""
    import ctypes  # here: most processes never need it

    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols the process has: glibc's, on Linux
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
