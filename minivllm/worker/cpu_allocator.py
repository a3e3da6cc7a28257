"""Appendix A — keep freed memory in the process: a CPU engine's allocator setting.

Every engine step allocates activations of up to tens of megabytes ([2048 tokens, 3072] floats
is 25 MB) and frees them a few milliseconds later. With its default settings glibc's `malloc`
hands large blocks back to the operating system: blocks over a (moving) threshold are mapped
and unmapped one by one, and free memory at the top of the heap is trimmed. The next step
then touches fresh pages, and the kernel has to fault in and zero every 4 KiB page again.
On the 64-request throughput workload that cost several seconds of system time and about
10% of the engine's throughput.

Two `mallopt` settings stop it: serve blocks up to 32 MiB (the most glibc allows) from the
heap, and trim only when a gigabyte lies free. This is what GPU engines get for free from
PyTorch's caching allocator, and what vLLM's CPU backend asks for by preloading tcmalloc.
The setting is process-wide, so the benchmark applies it before any method runs: every
method, transformers' included, is measured with the same allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> names for mallopt's parameters
M_MMAP_THRESHOLD = -3
LARGEST_HEAP_BLOCK = 32 << 20  # glibc refuses a larger mmap threshold on 64-bit machines
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory_in_process() -> bool:
    """Apply the settings above; returns False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST_HEAP_BLOCK)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def release_freed_memory() -> bool:
    """Give the memory freed so far back to the operating system (glibc's `malloc_trim`), from
    every thread's arena. With the settings above a process keeps what it frees, which is the
    point for one engine; a process that builds many engines one after the other (a test suite)
    calls this between them. Returns False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim(0)
    return True
