"""One safetensors file written as its tensors arrive (``write_safetensors_incrementally``): the header first,
then each tensor, written and hashed on threads behind the caller."""
from __future__ import annotations

import json
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..records.fingerprints import HASH_BATCH_BYTES, HASH_THREADS, segment_digests


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


#: safetensors dtype names (https://github.com/huggingface/safetensors: the header's ``dtype`` field).
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


#: Bytes handed to the writing threads and not yet written, at most (beyond one batch): the next unit is
#: packed while the last one's bytes are written and hashed. Host memory while writing is then a unit, the next
#: one read ahead and this: below a pass's (a layer, the next read ahead, the calibration activations).
WRITE_BEHIND_BYTES = 512 << 20


class _WrittenBehind:
    """A file written by one thread and, when ``digests`` is a list, each buffer's sha256 appended to it in
    order (``report.WeightsFingerprint``'s segments), hashed on :data:`report.HASH_THREADS` threads; all behind
    the caller, in the order the buffers are handed over (:meth:`put`). Buffers go to the threads in batches
    (of :data:`report.HASH_BATCH_BYTES`: a packed MoE layer is thousands of small tensors, and a hand-over each
    cost more than their bytes); at most :data:`WRITE_BEHIND_BYTES` wait. File writes and sha256 release the GIL, so
    the caller's next unit is read and packed meanwhile (on a lent H200 one sha256 over the output ran at
    1.2 GB/s, and was the write's last step)."""

    def __init__(self, handle, digests: list | None):
        self._handle = handle
        self._digests = digests
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="recipe-output-writer")
        self._hashers = None if digests is None else ThreadPoolExecutor(HASH_THREADS,
                                                                        thread_name_prefix="recipe-output-hasher")
        self._batch: list = []
        self._batch_bytes = 0
        #: (the batch's write, its hash or None, its bytes), in order
        self._pending: deque[tuple[Future, Future | None, int]] = deque()
        self._bytes = 0
        self._failed = False

    def _write(self, buffers) -> None:
        if self._failed:  # nothing after a failed write: the caller raises its error
            return
        try:
            for data in buffers:
                self._handle.write(data)
        except BaseException:
            self._failed = True
            raise

    def put(self, tensor: torch.Tensor | bytes) -> None:
        """Write ``tensor``'s bytes (a host tensor, kept alive until written and hashed) or ``bytes`` next."""
        data = tensor if isinstance(tensor, bytes) else tensor.reshape(-1).view(torch.uint8).numpy().data
        if self._batch and self._batch_bytes + len(data) > HASH_BATCH_BYTES:
            self._hand_over()
        self._batch.append(data)
        self._batch_bytes += len(data)

    def _hand_over(self) -> None:
        while self._pending and self._bytes > WRITE_BEHIND_BYTES:
            self._wait_oldest()
        batch, size = self._batch, self._batch_bytes
        self._batch, self._batch_bytes = [], 0
        hashed = None if self._hashers is None else self._hashers.submit(segment_digests, batch)
        self._pending.append((self._writer.submit(self._write, batch), hashed, size))
        self._bytes += size

    def _wait_oldest(self) -> None:
        written, hashed, size = self._pending.popleft()
        self._bytes -= size
        written.result()  # a failed write raises here
        if hashed is not None:
            self._digests.extend(hashed.result())  # in file order: the batches are waited for in order

    def finish(self) -> None:
        """Wait for every write and hash (raising the first failure; the digests are appended as their batches
        are waited for); the threads end either way."""
        try:
            if self._batch:
                self._hand_over()
            while self._pending:
                self._wait_oldest()
        finally:
            for written, hashed, _ in self._pending:
                for future in (written, hashed):
                    if future is not None:
                        future.cancel()
            for pool in (self._writer, self._hashers):
                if pool is not None:
                    pool.shutdown(wait=True)


def write_safetensors_incrementally(path: Path, layout: dict[str, torch.Tensor], chunks,
                                    digests: list | None = None) -> int:
    """A safetensors file whose tensors arrive in ``chunks`` (an iterable of ``{name: tensor}``) and are
    written as they come, so at most one chunk (and :data:`WRITE_BEHIND_BYTES` being written) is in memory.
    ``layout`` (meta tensors allowed) fixes the header: names in file order with dtype and shape; every
    chunk tensor must match it. The file format: an 8-byte little-endian header length, the JSON header
    (``__metadata__`` plus ``dtype``, ``shape`` and contiguous ``data_offsets`` per tensor, space-padded to
    8 bytes), then the raw little-endian data. ``safetensors.torch.save_file`` needs every tensor at once;
    the files are byte-compatible. ``digests`` (a list): the sha256 of each of the file's segments
    (``report.safetensors_segments``: the header with its length, then each tensor) appended in file order,
    hashed while they are written (:class:`_WrittenBehind`)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in layout.items():
        size = nbytes(tensor)
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    expected = iter(layout.items())
    with open(path, "wb") as handle:
        behind = _WrittenBehind(handle, digests)
        try:
            behind.put(len(text).to_bytes(8, "little") + text)
            for chunk in chunks:
                for name, tensor in chunk.items():
                    want, spec = next(expected)
                    if name != want or tensor.dtype != spec.dtype or tensor.shape != spec.shape:
                        raise RuntimeError(f"{path.name}: got {name} {tuple(tensor.shape)} {tensor.dtype}, "
                                           f"expected {want} {tuple(spec.shape)} {spec.dtype}")
                    behind.put(tensor.detach().to("cpu").contiguous())  # a no-op for write_checkpoint's
        finally:
            behind.finish()
    if next(expected, None) is not None:
        raise RuntimeError(f"{path.name}: fewer tensors written than its header lists")
    return offset
