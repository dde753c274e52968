"""The run report (``report.json`` in every output directory): a typed, versioned pydantic model.

``Report`` is the only writer (``Report.write``) and reader (``load_report`` / ``Report.read``) of
``report.json``; docs/report.md documents every field. ``format_version`` is :data:`FORMAT_VERSION`; an
older report (format 0: written before the field existed, without the per-step ``calibration_passes``;
format 1: without ``weights_sha256`` and ``model.base_model``; format 2: ``weights_sha256`` of the whole files'
bytes, which :func:`weights_fingerprint` no longer computes, so it is dropped) is read and upgraded, the missing
fields ``None``; a newer format is refused with one line.
Modifier-specific parts (a step's ``result``, evaluation results) stay JSON objects: their keys belong to
the modifier or the evaluation, documented beside them.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import RecipeError

#: Version of the report layout written by this engine.
FORMAT_VERSION = 3
REPORT_FILE = "report.json"
#: Threads that hash a fingerprint's segments (sha256 releases the GIL: about 1.2 GB/s per core).
HASH_THREADS = min(8, os.cpu_count() or 1)


class ReportError(RecipeError):
    """A ``report.json`` that cannot be read (missing, not JSON, a newer format, invalid)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")  # NaN stays NaN, as json.dumps


class RecipeRecord(_Section):
    """The recipe that produced the output."""

    name: str
    file: str = Field(description="recipe file, or <python> for a recipe passed as an object")
    sha256: str = Field(description="sha256 of the recipe text as loaded")
    resolved_sha256: str = Field(description="sha256 of the canonical resolved recipe (recipe.yaml)")
    git: dict[str, Any] | None = Field(description="commit/tracked/dirty of the recipe file, if in git")
    overrides: list[str] = Field(description="command-line overrides applied to the file")


class ModelRecord(_Section):
    spec: str = Field(description="the recipe's model field")
    kind: str = Field(description="how it was found (builtin, local, hub, in-memory)")
    location: str | None = Field(None, description="the directory read (absent for in-memory)")
    license: str | None = Field(None, description="the source's license (its model card, or GGUF metadata)")
    gguf: str | None = Field(None, description="the GGUF file the weights were converted from, if any")
    base_model: str | None = Field(None, description="the hub id the source comes from (a hub source, a builtin "
                                                     "alias's, an output's own base_model); None when unknown")
    packed: str | None = Field(None, description="how the source's weights are packed (format, bits, groups), "
                                                 "read dequantized; None when they are not")


class DataRecord(_Section):
    dataset: str | list[str] = Field(description="the calibration source, or the sources of a mix")
    origin: str = Field(description="the file or dataset actually read")
    tokens_available: int
    samples: int
    seq_len: int
    seed: int
    fingerprint: str = Field(description="sha256 of the calibration windows' int64 token ids")
    generated: dict | None = Field(None, description="calibration.generate: how the model wrote its own windows "
                                                     "(prompt and new tokens, temperature, seed, cache hit or "
                                                     "written, the cache key, seconds)")


class ModelSize(_Section):
    parameters: int
    layers: int
    layer_origin: list[list[int]] | None = Field(None, description="(after) original layers behind each layer")


class StepRecord(_Section):
    """One recipe step as it ran."""

    index: int
    modifier: str
    group: int | None = Field(None, description="pass group: consecutive layer steps share one group and pass "
                                                "(format 0: absent)")
    params: dict[str, Any]
    wall_s: float = Field(description="this step's own time (its statistics forwards, compression, finish)")
    shared_pass: bool = Field(description="ran inside a layer pass shared with neighbouring steps")
    pass_shared_s: float = Field(description="the group's time not attributable to one step (loading, "
                                             "shared forwards); the same number for every step of a group")
    calibration_passes: int | None = Field(None, description="calibration passes the step's group made, "
                                                             "counted by the session (format 0: absent)")
    layers_after: int
    peak_rss_mib: float | None = None
    estimate_rss_mib: float | None = None
    result: dict[str, Any] = Field(description="the modifier's own report entries; an optional 'headline' "
                                               "(one line: what the step chose) is printed under "
                                               "apply's summary table")


class Evaluation(_Section):
    before: dict[str, Any]
    after: dict[str, Any] | None = None
    retained: dict[str, float | None] | None = None
    quality_gate: Literal["passed", "failed"] | None = None


class PeakMemory(_Section):
    rss_mib: float
    cuda_mib: float | None = None
    estimate_rss_mib: float | None = None
    estimate_device_mib: float | None = None  # the activations on an accelerator: ``recipe plan``'s device peak


class Checkpoints(_Section):
    written: int
    seconds: float
    bytes: int
    skipped: int = 0  # layer checkpoints a pass skipped to stay within --checkpoint-budget


class StreamRecord(_Section):
    bytes_read: int
    bytes_staged: int


class Resumed(_Section):
    group: int
    layer: int | None


class ExportRecord(_Section):
    file: str
    type: str
    architecture: str
    tensors: int
    bytes: int


class Report(_Section):
    """``report.json``: provenance, sizes, every step's record, evaluation, memory."""

    format_version: int = FORMAT_VERSION
    recipe: RecipeRecord
    packages: dict[str, str]
    device: str
    dtype: str
    streamed: bool
    rank: int
    ranks: int
    model: ModelRecord
    data: DataRecord
    before: ModelSize
    after: ModelSize
    steps: list[StepRecord]
    stock_checkpoint: bool
    calibration_layer_runs: int
    calibration_layer_batches: int
    calibration_passes: int | None = Field(None, description="calibration passes of all steps (format 0: absent)")
    activations_on: str | None = Field(None, description="where calibration activations lived between layers "
                                                         "(calibration.offload resolved): cpu or the device")
    peak_memory: PeakMemory
    evaluation: Evaluation | None = None
    checkpoints: Checkpoints | None = None
    resumed: Resumed | None = None
    stream: StreamRecord | None = None
    export: ExportRecord | None = None
    weights_sha256: str | None = Field(None, description="weights_fingerprint of the written output (format < 3: "
                                                         "absent, or of another definition: dropped)")
    notes: list[str] = Field(default_factory=list, description="what the run did that its user would not "
                                                               "assume, one sentence each (printed under the "
                                                               "summary and in the model card)")

    @classmethod
    def from_data(cls, data: Any, origin: str = "report") -> "Report":
        """Validate a report's JSON data; format 0 is upgraded, a newer format refused (one line)."""
        if not isinstance(data, dict):
            raise ReportError(f"{origin}: not a JSON object")
        version = data.get("format_version", 0)
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ReportError(f"{origin}: format_version {version!r} is newer than this recipe-engine reads "
                              f"({FORMAT_VERSION}); upgrade recipe-engine")
        if version < FORMAT_VERSION:  # a format-2 fingerprint hashed the whole files: not comparable
            data = {**{k: v for k, v in data.items() if k != "weights_sha256"}, "format_version": FORMAT_VERSION}
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ReportError(f"{origin}: invalid report ({exc.error_count()} problems; first: {where}: "
                              f"{first['msg']})") from None

    @classmethod
    def read(cls, directory: str | Path) -> "Report":
        path = Path(directory).expanduser() / REPORT_FILE
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ReportError(f"{path}: not JSON ({exc})") from None
        return cls.from_data(data, str(path))

    def write(self, directory: str | Path) -> None:
        (Path(directory) / REPORT_FILE).write_text(self.to_json())

    def to_json(self) -> str:
        """The JSON text of ``report.json`` (a modifier's non-JSON value, e.g. a path, as its ``str``)."""
        return self.model_dump_json(indent=2, fallback=str)


@dataclass
class RunReport:
    """The sections of ``report.json`` as a run makes them (each set when the run reaches it; a resumed run
    restores ``evaluation`` and sets ``resumed``), made the validated :class:`Report` by :meth:`to_report`."""

    recipe: RecipeRecord
    packages: dict[str, str]
    device: str
    dtype: str
    streamed: bool
    rank: int
    ranks: int
    model: ModelRecord | None = None
    data: DataRecord | None = None
    before: ModelSize | None = None
    activations_on: str | None = None
    evaluation: dict[str, Any] | None = None
    steps: list[dict[str, Any]] | None = None
    after: ModelSize | None = None
    stock_checkpoint: bool | None = None
    checkpoints: Checkpoints | None = None
    calibration_passes: int | None = None
    calibration_layer_runs: int | None = None
    calibration_layer_batches: int | None = None
    stream: StreamRecord | None = None
    peak_memory: PeakMemory | None = None
    resumed: dict[str, Any] | None = None
    export: ExportRecord | None = None
    weights_sha256: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_report(self) -> Report:
        """The finished report (a section never set is left out, as pydantic then requires or defaults it)."""
        return Report.model_validate({f.name: getattr(self, f.name) for f in fields(self)
                                      if getattr(self, f.name) is not None})


def load_report(directory: str | Path) -> Report:
    """The :class:`Report` of a recipe output directory (its ``report.json``)."""
    return Report.read(directory)


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
