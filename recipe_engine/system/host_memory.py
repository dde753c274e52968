"""This process's host memory: resident size and its peak per phase, what the host has available, and
returning freed heap pages to the OS (glibc)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
from pathlib import Path


def current_rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def high_water_bytes() -> int:
    """This process's peak resident memory: Linux's ``VmHWM``, the high-water mark of its own address space.
    ``getrusage``'s ``ru_maxrss`` is not used where ``VmHWM`` exists: Linux carries it across ``fork`` and
    ``execve``, so a process started by a large one (a notebook, a benchmark harness that has just written a
    checkpoint) reports its parent's resident size at the fork as its own peak (a parent holding 3 GiB: a
    child of 13 MiB reported 3 GiB)."""
    try:
        line = next(row for row in Path("/proc/self/status").read_text().splitlines() if row.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return int(line.split()[1]) * 1024


class PeakWatch:
    """Peak resident memory per phase of a run (e.g. per step) and overall.

    Linux keeps one high-water mark per process (``VmHWM``, :func:`high_water_bytes`), which writing ``5``
    to ``/proc/self/clear_refs`` resets; ``start`` resets it, ``stop`` reads it. Where the reset is not
    allowed, phases report ``None`` and the overall peak is the high-water mark over the whole process.
    """

    CLEAR_REFS = Path("/proc/self/clear_refs")

    def __init__(self):
        self.overall_bytes = high_water_bytes()
        self.resets = self.CLEAR_REFS.exists() and self._try_reset()

    def _try_reset(self) -> bool:
        try:
            self.CLEAR_REFS.write_text("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        self.overall_bytes = max(self.overall_bytes, high_water_bytes())
        if self.resets:
            self._try_reset()

    def stop(self) -> int | None:
        """Peak bytes since ``start`` (None where the high-water mark cannot be reset)."""
        peak = high_water_bytes()
        self.overall_bytes = max(self.overall_bytes, peak)
        return peak if self.resets else None


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library (``ctypes``), looked up once: ``find_library`` runs ``ldconfig`` each call."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def release_freed_memory_eagerly(threshold: int = 2**20) -> bool:
    """Fix glibc's mmap threshold so that freed buffers of ``threshold`` bytes or more go back to the OS.

    glibc raises the threshold dynamically after a large block is freed (up to 32 MiB), after which
    layer-sized tensors come from the heap and stay in the process when freed: a streamed run's resident
    memory then grows with the number of layers it has passed through (measured: 32 layers of hidden 1024,
    peak 2.6 GB with the dynamic threshold vs 1.6 GB fixed). Returns False where it does not apply (not glibc).
    """
    try:
        return bool(_libc().mallopt(-3, threshold))  # M_MMAP_THRESHOLD (also disables the dynamic threshold)
    except (OSError, AttributeError):
        return False


def trim_heap() -> bool:
    """Give free heap pages back to the OS (glibc ``malloc_trim(0)``) after a burst of small transient
    allocations: tokenizing the calibration text (SmolLM2's tokenizer on the Wikipedia sample: 442 k
    tokens leave ~90 MB of freed encodings in the heap), and each streamed unit's release (a layer's
    forwards and solves leave ~20 MB of free heap pages; measured on the depth series). Returns False where
    it does not apply."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False


#: Linux's ``MADV_DONTNEED``: drop a range's pages from this process (a private file mapping re-reads the file).
MADV_DONTNEED = 4
#: Bytes of a page (the unit ``madvise`` drops, and a memory-mapped tensor's pages are read from disk in).
PAGE_BYTES = 4096


def _file_mappings(suffix: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files whose name ends with ``suffix`` (``/proc/self/maps``)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(suffix):
            start, stop = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((start, stop))
    return ranges


def own_mapped_weights(modules, suffix: str = ".safetensors") -> int:
    """Give every parameter and buffer of ``modules`` that lies in a memory-mapped checkpoint file
    (transformers' ``from_pretrained`` maps safetensors files and keeps tensors of the same dtype as views of
    the mapping) memory of its own, and drop the mapped pages as each is copied; returns the bytes moved.

    Why: such a mapping is copy-on-write and lives as long as any tensor viewing it. A step that changes a
    weight in place (FuseNorm, GPTQ) turns its pages into anonymous copies inside the mapping; when a later
    step removes or replaces that layer (FlattenGPT's merges, a pruned linear), those pages stay in the process
    for the rest of the run (measured on SmolLM2: 10 layers changed then deleted kept their 130 MB, which
    ``malloc_trim`` cannot return). Owned tensors are freed like any other. The copy is tensor by tensor and
    each source range is dropped after it (``madvise(MADV_DONTNEED)``: unchanged file pages, re-read from the
    file if anything still looked), so the resident peak grows by the largest tensor, not by the model.
    Identity is kept (``Parameter.data`` is replaced), so tied weights stay tied. The engine passes the decoder
    layers, the units steps replace: the embeddings and head stay mapped, resident only as far as they are read
    (a run that never computes logits reads one embedding row per token)."""
    import torch  # deferred: nothing else here needs torch

    mappings = _file_mappings(suffix)
    if not mappings:
        return 0
    moved = 0
    for module in (inner for outer in modules for inner in outer.modules()):
        for slots in (module._parameters, module._buffers):
            for name, tensor in list(slots.items()):
                if tensor is None:
                    continue
                storage = tensor.untyped_storage()
                start, size = storage.data_ptr(), storage.nbytes()
                if not size or not any(low <= start < high for low, high in mappings):
                    continue
                copy = torch.empty_like(tensor)
                copy.copy_(tensor.detach())
                if isinstance(tensor, torch.nn.Parameter):
                    tensor.data = copy
                else:
                    slots[name] = copy
                first, last = -(-start // PAGE_BYTES) * PAGE_BYTES, (start + size) // PAGE_BYTES * PAGE_BYTES
                if last > first:
                    _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)
                moved += size
    return moved


def available_memory() -> int:
    """``MemAvailable`` of this host in bytes (Linux), else total physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
