"""Handing memory the process has freed back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library, another OS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> bool:
    """Ask glibc to give freed heap memory back to the OS (``malloc_trim(0)``); True when it was asked.

    Tensors of a few MB come from malloc's heap, whose freed blocks stay in the process's RSS until something
    reuses them. Replacing a model's weights by new tensors (the bf16 decoder's fused projections) frees the old
    ones there: measured, SmolLM2-135M bf16, RSS after loading 0.42 GB above the imports without this, 0.29 GB
    with it (stock transformers: 0.29)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
