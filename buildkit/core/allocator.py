"""glibc malloc told to keep freed buffers of a build for reuse, in one heap it can hand back.

A build allocates and frees buffers of 0.1-30 MB at a high rate on several threads (blocks of
rows, verify's temporaries, the load check's layers). glibc's defaults hand them back to the
OS at once, so the next buffer faults its pages in again, and a page fault is dear on small
VMs. ``tune`` serves buffers up to ``MMAP_THRESHOLD`` from the heap, trims the heap's top only
once ``TRIM_THRESHOLD`` of it is free, and keeps every thread in the main arena
(``ARENA_MAX``): ``malloc_trim`` (``release``) never shrinks a thread arena's top, so with
per-thread arenas up to 64 MB an arena stayed in the process between steps. ``tune_imported``
then turns mlx's own buffer cache off, a second reserve of the same buffers. Figures:
bench/RESULTS.md, "Speed tricks re-measured".
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (half its heap size)
TRIM_THRESHOLD = 256 << 20  # both must be set: setting one alone freezes the other at its default
ARENA_MAX = 1  # threads created after ``tune`` share the main arena (earlier ones keep theirs)
ENV = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
    "GLIBC_TUNABLES",
)
_tuned = False


@functools.cache
def libc() -> ctypes.CDLL:
    """The process's C library (the store's ``syncfs`` and ``sync_file_range`` come from it too)."""
    return ctypes.CDLL(None, use_errno=True)


def tune(force: bool = False) -> bool:
    """Set both thresholds for this process, unless it is not on glibc or malloc's own
    environment variables are set (the user's choice stands; ``force``: a Dask nanny's
    is not); True if they were set."""
    global _tuned
    if not sys.platform.startswith("linux") or (any(k in os.environ for k in ENV) and not force):
        return False
    try:
        mallopt = libc().mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    settings = (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    _tuned = all([mallopt(param, value) for param, value in (*settings, (M_ARENA_MAX, ARENA_MAX))])
    return _tuned


def tune_imported() -> None:
    """After ``tune``, once mlx is imported: its buffer cache off (malloc keeps freed buffers
    already). Without ``tune`` mlx's cache stays, as it is the only reserve then."""
    mx = sys.modules.get("mlx.core")
    # another thread may be importing mlx right now (a partly initialised module): skip, a later
    # call (each step start, or that import's own) sets it
    if _tuned and getattr(mx, "set_cache_limit", None) is not None:
        mx.set_cache_limit(0)


def release() -> None:
    """Hand the free pages of malloc's heaps back to the OS (``malloc_trim``): between steps,
    so a step is not charged for the buffers earlier steps freed (kept for reuse by ``tune``,
    they add up over a long build)."""
    if not _tuned:
        return
    try:
        libc().malloc_trim(0)
    except AttributeError:  # not glibc
        pass
