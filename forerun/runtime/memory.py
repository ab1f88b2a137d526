"""Host memory for caches: zero-filled buffers whose pages become resident only when written.

`torch.zeros` on a CPU writes every byte, so a KV pool sized for the worst case is resident in
full from the start (a 5 GB budget is 5 GB of RSS at idle). `calloc` (what `numpy.zeros` calls)
instead maps large buffers to the kernel's zero page: a page costs memory once a token is
written into it, and reads of unwritten slots still see zeros, exactly as `torch.zeros` would.
Resident memory then follows the KV actually in use (up to its high-water mark).

Also `return_free_memory`: glibc keeps freed heap memory mapped for reuse; after loading (the
dequantization's temporaries, the weights before oneDNN repacked them) or a burst of requests
it asks glibc to hand the free pages back (`malloc_trim`). Measured on the default pair, bf16:
8.0 -> 6.5 GB RSS after loading. Elsewhere (another libc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from functools import cache

import numpy as np
import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero tensor of `shape` whose host pages are committed on first write (CPU); any other
    device gets `torch.zeros`."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(max(nbytes, 1), dtype=np.uint8))  # calloc: zero pages
    return raw[:nbytes].view(dtype).view(shape)


@cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another libc)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def return_free_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc's malloc_trim); False where there is
    no such call."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))
