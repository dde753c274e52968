"""The run report (``report.json`` in every output directory): a typed, versioned pydantic model.

``Report`` is the only writer (``Report.write``) and reader (``load_report`` / ``Report.read``) of
``report.json``; docs/report.md documents every field. ``format_version`` is :data:`FORMAT_VERSION`; an
older report (format 0: written before the field existed, without the per-step ``calibration_passes``;
format 1: without ``weights_sha256`` and ``model.base_model``; format 2: ``weights_sha256`` of the whole files'
bytes, which ``fingerprints.weights_fingerprint`` no longer computes, so it is dropped) is read and upgraded, the
missing fields ``None``; a newer format is refused with one line.
A step's ``result`` stays a JSON object: its keys belong to the modifier, documented beside it. The evaluation's
``before`` / ``after`` / ``retained`` are read as the typed results of ``evaluation.py`` and written by their own
``to_json``.
"""
from __future__ import annotations

import json
from dataclasses import field, fields, make_dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, ValidationError

from ..errors import RecipeError
from ..system.cleanup import read_marker
from .evaluation import Evaluation, Retained

#: Version of the report layout written by this engine.
FORMAT_VERSION = 3
REPORT_FILE = "report.json"


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


def _typed(kind: type):
    """A field holding ``kind`` (a typed evaluation result): read from its JSON by ``from_json`` (or given typed),
    written by its ``to_json``."""
    return Annotated[kind, PlainValidator(lambda value: value if isinstance(value, kind) else kind.from_json(value)),
                     PlainSerializer(lambda value: value.to_json())]


class EvaluationRecord(_Section):
    before: _typed(Evaluation)
    after: _typed(Evaluation) | None = None
    retained: _typed(Retained) | None = None
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
    format: str = Field("gguf", description="the file format (absent before there were others: gguf)")
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
    evaluation: EvaluationRecord | None = None
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


#: ``Report``'s sections that a run keeps as JSON until the end (a resume checkpoint saves them as such).
_KEPT_AS_JSON = {"evaluation": dict[str, Any], "steps": list[dict[str, Any]], "resumed": dict[str, Any]}
#: ``Report``'s sections a run knows from its start (``RunReport`` requires them).
_GIVEN_AT_START = ("recipe", "packages", "device", "dtype", "streamed", "rank", "ranks")


def _draft_fields() -> list[tuple]:
    """``Report``'s sections as dataclass fields: those given at the start required, every other one ``None``
    until the run reaches it (``notes``: an empty list), with ``Report``'s types."""
    given, later = [], []
    for name, info in Report.model_fields.items():
        if name == "format_version":
            continue
        kind = _KEPT_AS_JSON.get(name, info.annotation)
        if name in _GIVEN_AT_START:
            given.append((name, kind))
        elif name == "notes":
            later.append((name, kind, field(default_factory=list)))
        else:
            later.append((name, kind | None, field(default=None)))
    return given + later


def _to_report(self) -> Report:
    """The finished report (a section never set is left out, as pydantic then requires or defaults it)."""
    return Report.model_validate({f.name: getattr(self, f.name) for f in fields(self)
                                  if getattr(self, f.name) is not None})


#: The sections of ``report.json`` as a run makes them (each set when the run reaches it; a resumed run restores
#: ``evaluation`` and sets ``resumed``), made the validated :class:`Report` by ``to_report``: ``Report``'s own
#: fields (:func:`_draft_fields`), so the two cannot drift apart.
RunReport = make_dataclass("RunReport", _draft_fields(), namespace={"to_report": _to_report,
                                                                    "__module__": __name__})


def load_report(directory: str | Path) -> Report:
    """The :class:`Report` of a recipe output directory (its ``report.json``)."""
    return Report.read(directory)


OUTPUT_KIND = "recipe-output"


def is_recipe_output(directory: Path) -> bool:
    """An earlier ``recipe apply`` output: our marker, or (written before the marker existed) a
    ``report.json`` with a recipe record beside ``recipe.yaml``."""
    marker = read_marker(directory)
    if marker is not None:
        return marker.get("type") == OUTPUT_KIND and marker.get("state") == "complete"

    try:
        load_report(directory)
    except ReportError:
        return False
    return (directory / "recipe.yaml").is_file()
