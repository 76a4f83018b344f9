"""The C allocator setting that the trainers, the evaluation and the benchmark scripts run with.

glibc hands large freed blocks straight back to the kernel (blocks above its mmap threshold, and
the top of the heap past its trim threshold), so the next tensor of that size is built from fresh
pages, and each page costs a fault. A training or prefill loop frees and allocates tensors of the
same sizes over and over, and on this project's machines (virtual, 2 cores) the faults cost more
than the work: a fresh 8 MB tensor ~1 ms against 0.2 ms to fill it, a fresh 210 MB logits tensor
50 ms against 8 ms. Kept in the heap instead, freed memory is reused without faults; the process
then holds on to its peak, which a training or evaluation run reaches every step anyway.
Measured effect: docs/BENCHMARKS.md ("Allocator").
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_MAX = -4
LARGEST_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int


def retain_freed_memory():
    """Keep freed memory in the process for reuse: no mmap'd blocks, no trimming of the heap top.

    Applies to allocations made after the call (fork children inherit it). Returns True when the
    C library took the setting, False where there is no glibc mallopt (the default allocator stays).
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, LARGEST_TRIM_THRESHOLD))
