"""The host machine: how much memory is available now (a leaf: imports nothing of the
project). Checks that would otherwise end in a `MemoryError` minutes in – random inputs
larger than RAM, a partition too large to plan – compare their estimates with it."""

from __future__ import annotations

import os

__all__ = ["available_memory"]


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable; else free pages), or
    None when the system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
