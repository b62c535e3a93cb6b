"""This host's memory as its ranks see it: /proc/meminfo and the system's pages, or less
where this process's cgroup (v2: a container's limit) sets less."""

from __future__ import annotations

import os
from pathlib import Path


def total() -> int:
    """What this host holds for its ranks, in bytes: its physical memory, or its cgroup's
    limit where lower. What it holds, not what is free now: ranks that start together
    check it while others allocate."""
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit, _ = _cgroup()
    return phys if limit is None else min(phys, limit)


def available() -> int | None:
    """MemAvailable of /proc/meminfo, or less where the cgroup's limit leaves less; None
    where neither is known."""
    got = []
    try:
        with open("/proc/meminfo") as f:
            got += [int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")]
    except (OSError, ValueError):
        pass
    limit, used = _cgroup()
    if limit is not None and used is not None:
        got.append(limit - used)
    return min(got) if got else None


def _cgroup() -> tuple[int | None, int | None]:
    """This process's cgroup's memory limit and use (None: no limit, or not known)."""
    cg = Path("/sys/fs/cgroup")
    try:
        text = (cg / "memory.max").read_text().strip()
        limit = None if text == "max" else int(text)
    except (OSError, ValueError):
        return None, None
    try:
        return limit, int((cg / "memory.current").read_text())
    except (OSError, ValueError):
        return limit, None
