"""Keep glibc from handing chunk-sized message buffers back to the kernel.

libzmq allocates every received message (a 1-4 MiB chunk) with ``malloc`` on its I/O thread
and frees it once the chunk is copied into the snapshot buffer. With glibc's defaults a block
that size is ``mmap``ed and ``munmap``ed each time, or trimmed off the heap top, so every
chunk costs page faults and the kernel zeroing fresh pages: about 5% of the CPU of a loopback
relay chain on two cores, measured with ``perf``. A fixed mmap threshold of 32 MiB (glibc's
ceiling on 64-bit) and a high trim threshold let the freed blocks be reused instead.

Best effort: on a libc without ``mallopt`` (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # HEAP_MAX_SIZE / 2: glibc refuses anything larger
TRIM_THRESHOLD = 512 << 20

_done = False


def keep_chunk_buffers() -> bool:
    """Tune this process's malloc once; True if glibc accepted both settings."""
    global _done
    if _done:
        return True
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _done


def trim() -> bool:
    """Hand the heap's free memory back to the kernel now (glibc ``malloc_trim``): after a
    model load or an install the transient copies are free but, with the thresholds above,
    kept by malloc; a worker's resident set would stay at its peak. True if glibc did it."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
