"""glibc malloc told to keep freed buffers of a build for reuse.

A build allocates and frees buffers of 0.1-30 MB at a high rate on several threads: blocks
of rows, numpy temporaries of verify's arithmetic, and above all mlx's arrays as the load
check reads the published shards one layer at a time and lets each go. glibc starts with a
128 KiB mmap threshold (raised only as mmapped blocks are freed) and trims a thread's heap
back to the OS as soon as its free top passes twice that, so the next buffer faults its
pages in again. A page fault is dear on this project's VMs. In a cold xl build of the bench
fixture, the load check's reads alone faulted in ~110 000 pages; with ``tune`` ~11 000, and
the whole build 170 000-190 000 -> 54 000-60 000 faults, 1.3 s less system time (perf
``page-faults`` and ``/usr/bin/time``, three alternating rounds).

``tune`` serves buffers up to ``MMAP_THRESHOLD`` from the heap and trims a heap only once
``TRIM_THRESHOLD`` of its top is free: memory a build keeps beyond its live buffers is at
most that per arena (peak RSS of that build: 275-302 MB against 268-293 MB).

mlx keeps a buffer cache of its own on top of malloc's: freed arrays stay with mlx for the next
array of the same size (up to 32 MB by default on the CPU; ~30 MB of it held through a cold
xl build). With malloc keeping freed buffers, that is a second copy of the same reserve;
``tune_imported`` turns it off once mlx is imported: peak RSS of a cold xl build of the bench
fixture 280-288 MB -> 256-257 MB, page faults 54-56 k -> 51-52 k (three alternating rounds).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (half its heap size)
TRIM_THRESHOLD = 64 << 20  # both must be set: setting one alone freezes the other at its default
ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
_tuned = False


@functools.cache
def libc() -> ctypes.CDLL:
    """The process's C library (the store's ``syncfs`` and ``sync_file_range`` come from it too)."""
    return ctypes.CDLL(None, use_errno=True)


def tune() -> bool:
    """Set both thresholds for this process, unless it is not on glibc or malloc's own
    environment variables are set (the user's choice stands); True if they were set."""
    global _tuned
    if not sys.platform.startswith("linux") or any(k in os.environ for k in ENV):
        return False
    try:
        mallopt = libc().mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    _tuned = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _tuned


def tune_imported() -> None:
    """After ``tune``, once mlx is imported: its buffer cache off (malloc keeps freed buffers
    already). Without ``tune`` mlx's cache stays, as it is the only reserve then."""
    mx = sys.modules.get("mlx.core")
    if _tuned and mx is not None:
        mx.set_cache_limit(0)
