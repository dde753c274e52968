"""Fingerprints of an output's weights: sha256 over the safetensors files' segments, hashed on several cores while
the checkpoint writer writes them or read back from the files (``report.json``'s ``weights_sha256``, what
``recipe card --eval`` matches evaluation records against)."""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: Threads that hash a fingerprint's segments (sha256 releases the GIL: about 1.2 GB/s per core).
HASH_THREADS = min(8, os.cpu_count() or 1)


class WeightsFingerprint:
    """The weights' fingerprint: sha256 over the weight files in name order, each as its name, a NUL and the
    sha256 digests of its segments (:func:`safetensors_segments`). Segments hash independently, on several
    cores, where one sha256 over the files' bytes runs on one (1.2 GB/s on a lent H200's host, 0.4-1 GB/s on
    others: the last step of writing a large output). Fed by the checkpoint writer as it writes the files, or
    by :func:`weights_fingerprint` reading them."""

    def __init__(self):
        self._sha = hashlib.sha256()

    def add_file(self, name: str, segment_digests) -> None:
        self._sha.update(name.encode() + b"\0")
        for digest in segment_digests:
            self._sha.update(digest)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def segment_digests(buffers) -> list[bytes]:
    """The sha256 digest of each buffer (bytes-like)."""
    return [hashlib.sha256(buffer).digest() for buffer in buffers]


#: Bytes of segments handed to one hashing task at once (a thread hand-over per tensor of a packed MoE layer's
#: thousands would cost more than hashing them).
HASH_BATCH_BYTES = 16 << 20


def in_batches(items, size=len) -> list[list]:
    """``items`` in order, grouped into consecutive runs of about :data:`HASH_BATCH_BYTES` by ``size`` (a larger
    item alone)."""
    batches, total = [[]], 0
    for item in items:
        if batches[-1] and total + size(item) > HASH_BATCH_BYTES:
            batches.append([])
            total = 0
        batches[-1].append(item)
        total += size(item)
    return batches if batches[-1] else []


def safetensors_segments(read, size: int) -> list[tuple[int, int]]:
    """``(start, end)`` byte ranges of a safetensors file of ``size`` bytes (``read(offset, n)``: its bytes) in
    file order: the 8-byte header length with the header, each tensor's bytes (by ``data_offsets``, empty ones
    too), and any bytes after the last tensor. Bytes that do not parse as a safetensors header are one segment,
    the whole file."""
    whole = [(0, size)]
    if size < 8:
        return whole
    length = int.from_bytes(read(0, 8), "little")
    if length > size - 8:
        return whole
    try:
        header = json.loads(read(8, length))
        ranges = sorted(tuple(int(v) for v in entry["data_offsets"]) for key, entry in header.items()
                        if key != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError):
        return whole
    base = 8 + length
    segments, at = [(0, base)], base
    for start, end in ranges:
        if start + base != at or end < start or end + base > size:  # gaps or overlaps: not a safetensors layout
            return whole
        segments.append((at, end + base))
        at = end + base
    return segments + ([(at, size)] if at < size else [])


#: Bytes one read of :func:`weights_fingerprint` asks for.
READ_BYTES = 16 << 20


def _ranges_digests(descriptor: int, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The sha256 of each ``(start, end)`` byte range of an open file, read by position (``os.pread``, which
    releases the GIL) :data:`READ_BYTES` at a time."""
    digests = []
    for start, end in ranges:
        sha = hashlib.sha256()
        for offset in range(start, end, READ_BYTES):
            sha.update(os.pread(descriptor, min(READ_BYTES, end - offset), offset))
        digests.append(sha.digest())
    return digests


def whole_files_sha256(directory: str | Path) -> str | None:
    """sha256 over a directory's ``*.safetensors`` files in name order, each name, a NUL and all its bytes, on
    one thread: the fingerprint ``recipe eval`` recorded before :class:`WeightsFingerprint` (to recognize such a
    record), and whether two writers wrote the same bytes; None when it holds none."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    sha = hashlib.sha256()
    for file in files:
        sha.update(file.name.encode() + b"\0")
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(READ_BYTES), b""):
                sha.update(block)
    return sha.hexdigest()


def weights_fingerprint(directory: str | Path) -> str | None:
    """:class:`WeightsFingerprint` of a checkpoint directory's ``*.safetensors`` files, read back (segments read
    by position and hashed on :data:`HASH_THREADS` threads; the files are not mapped, so this process's resident
    memory holds only the reads in flight): the same weights give the same value wherever the directory lies;
    None when it holds none."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    fingerprint = WeightsFingerprint()
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="recipe-fingerprint") as pool:
        for path in files:
            descriptor = os.open(path, os.O_RDONLY)
            try:
                read = lambda offset, n: os.pread(descriptor, n, offset)
                segments = safetensors_segments(read, os.fstat(descriptor).st_size)
                batches = in_batches(segments, size=lambda segment: segment[1] - segment[0])
                fingerprint.add_file(path.name, [digest for digests in
                                                 pool.map(lambda batch: _ranges_digests(descriptor, batch), batches)
                                                 for digest in digests])
            finally:
                os.close(descriptor)
    return fingerprint.hexdigest()
