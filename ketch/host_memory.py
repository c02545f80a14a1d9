"""How much host memory this machine has free: what sizes of host-side pools are checked against
(the CPU KV budget's fp32 dense weights, the hierarchical cache's host tier)."""
from __future__ import annotations

import os


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
