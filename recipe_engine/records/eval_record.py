"""``recipe eval --json`` records read back (``recipe card --eval``): bounded, validated, and accepted only
for the output they measured (the same weights and the same resolved recipe)."""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from ..system.file_kinds import special_kind
from .fingerprints import weights_fingerprint, whole_files_sha256
from .report import Report

#: The largest record read (a real one is a few KiB).
MAX_RECORD_BYTES = 16 << 20
#: ``perplexity.ppl`` is ``exp(perplexity.nll)`` within this relative tolerance (compared as ``|ln ppl − nll|``,
#: which no nll overflows); ``recipe eval`` computes the one from the other, so they agree to the last bit.
PPL_TOLERANCE = 1e-6
#: A share computed from counts (``value`` = ``passed / samples``, an ``average`` = the mean of its tasks'
#: values) agrees within this absolute tolerance (the float rounding of a mean of a few shares).
SHARE_TOLERANCE = 1e-9


def _read_bounded(path: str) -> Any:
    """The JSON of a regular file of at most :data:`MAX_RECORD_BYTES`, or one line."""
    fail = lambda message: RecipeError(f"--eval {path}: {message}")
    try:
        info = os.stat(path)  # before opening: opening a FIFO would wait for a writer
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else special_kind(Path(path).resolve())
            raise fail(f"is {kind or 'not a regular file'}, not a `recipe eval --json` record")
        if info.st_size > MAX_RECORD_BYTES:
            raise fail(f"is {info.st_size:,} bytes; a `recipe eval --json` record is at most {MAX_RECORD_BYTES:,}")
        with open(path, "rb") as handle:
            text = handle.read(MAX_RECORD_BYTES + 1)
    except OSError as exc:
        raise fail(f"cannot read: {exc.strerror or exc}") from None
    if len(text) > MAX_RECORD_BYTES:
        raise fail(f"grew past {MAX_RECORD_BYTES:,} bytes while being read")
    try:
        return json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise fail(f"not a `recipe eval --json` record (not JSON: {exc})") from None


def _number(path: str, value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        shown = "missing" if value is None else f"{json.dumps(value)[:40]} is not a finite number"
        raise RecipeError(f"--eval {path}: field {field}: {shown}")
    return float(value)


def _text(path: str, value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise RecipeError(f"--eval {path}: field {field}: expected a string, got {json.dumps(value)[:40]}")
    return value


def _object(path: str, value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise RecipeError(f"--eval {path}: field {field}: expected an object, got {json.dumps(value)[:40]}")
    return value


def _check_values(path: str, record: dict) -> None:
    """Every figure the card shows is a finite number, every name a string."""
    ppl, zero, generation = record.get("perplexity"), record.get("zero_shot"), record.get("generation")
    if ppl is None and zero is None and generation is None:
        raise RecipeError(f"--eval {path}: holds no perplexity, zero_shot or generation result")
    if ppl is not None:
        _object(path, ppl, "perplexity")
        _number(path, ppl.get("ppl"), "perplexity.ppl")
        _text(path, ppl.get("dataset"), "perplexity.dataset")
        for key in ("windows", "seq_len"):
            if isinstance(ppl.get(key), bool) or not isinstance(ppl.get(key), int):
                raise RecipeError(f"--eval {path}: field perplexity.{key}: expected an integer")
    for field, tasks in (("zero_shot", zero), ("generation", generation)):
        if tasks is not None:
            _object(path, tasks, field)
            _number(path, tasks.get("average"), f"{field}.average")
            for task, result in _object(path, tasks.get("tasks"), f"{field}.tasks").items():
                _object(path, result, f"{field}.tasks.{task}")
                _text(path, result.get("metric"), f"{field}.tasks.{task}.metric")
                _number(path, result.get("value"), f"{field}.tasks.{task}.value")
    if "date" in record:
        _text(path, record["date"], "date")


def _count(path: str, value: Any, field: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise RecipeError(f"--eval {path}: field {field}: {json.dumps(value)[:40]} is not an integer ≥ {least}")
    return value


def _check_consistency(path: str, record: dict, directory: str | Path) -> None:
    """The figures agree with each other (after ``_check_values``): ppl = exp(nll) (:data:`PPL_TOLERANCE`), every
    accuracy, pass rate and average a share in [0, 1], an average the mean of its tasks' values, and where a task
    counts them, passed ≤ samples and value = passed / samples (:data:`SHARE_TOLERANCE`). A record failing one
    was changed or damaged after `recipe eval` wrote it."""
    def bad(field: str, why: str) -> RecipeError:
        return RecipeError(f"--eval {path}: field {field}: {why}; not what `recipe eval` writes (a changed or "
                           f"damaged record): rerun `recipe eval {directory} --json FILE`")

    def share(value: float, field: str) -> None:
        if not 0 <= value <= 1:
            raise bad(field, f"{value:g} is not a share in [0, 1]")

    ppl = record.get("perplexity")
    if ppl is not None:
        nll = _number(path, ppl.get("nll"), "perplexity.nll")
        if nll < 0:
            raise bad("perplexity.nll", f"{nll:g} is negative (a mean negative log-likelihood is at least 0)")
        if ppl["ppl"] <= 0 or abs(math.log(ppl["ppl"]) - nll) > PPL_TOLERANCE:
            exp = f"{math.exp(nll):.6g}" if nll < 700 else "beyond a float"
            raise bad("perplexity.ppl", f"{ppl['ppl']:g} is not exp(perplexity.nll) = exp({nll:g}) = {exp}")
    for part in ("zero_shot", "generation"):
        if record.get(part) is None:
            continue
        tasks = record[part]["tasks"]
        for task, result in tasks.items():
            name = f"{part}.tasks.{task}"
            for key in ("value", "acc", "acc_norm"):
                if key in result:
                    share(_number(path, result[key], f"{name}.{key}"), f"{name}.{key}")
            if "passed" in result:
                samples = _count(path, result.get("samples"), f"{name}.samples", 1)
                passed = _count(path, result["passed"], f"{name}.passed", 0)
                if passed > samples:
                    raise bad(f"{name}.passed", f"{passed} passed of {samples} samples")
                if abs(result["value"] - passed / samples) > SHARE_TOLERANCE:
                    raise bad(f"{name}.value", f"{result['value']:g} is not passed / samples = {passed}/{samples}")
        share(record[part]["average"], f"{part}.average")
        if not tasks:
            raise bad(f"{part}.tasks", "no task (the average of nothing)")
        mean = sum(result["value"] for result in tasks.values()) / len(tasks)
        if abs(record[part]["average"] - mean) > SHARE_TOLERANCE:
            raise bad(f"{part}.average", f"{record[part]['average']:g} is not the mean of its tasks' values "
                                         f"({mean:g})")


def read_evaluation(path: str, report: Report, directory: str | Path) -> dict:
    """A ``recipe eval --json`` record of the output in ``directory`` (whose report is ``report``): refused
    when it measured other weights (``weights_sha256``; an output written before the report recorded it is
    fingerprinted now) or another resolved recipe, when it predates the fingerprint, or when a value it
    holds is not what ``recipe eval`` writes (``_check_values``) or its figures disagree (``_check_consistency``)."""
    record = _read_bounded(path)
    if not isinstance(record, dict) or not isinstance(record.get("model"), dict):
        raise RecipeError(f"--eval {path}: expected the JSON object `recipe eval --json` writes")
    model = record["model"]
    measured = model.get("weights_sha256")
    if "weights_sha256" not in model:
        raise RecipeError(f"--eval {path}: records no weights fingerprint (an older `recipe eval`); rerun "
                          f"`recipe eval {directory} --json FILE` and pass that file")
    expected = report.weights_sha256 or weights_fingerprint(directory)
    if measured != expected and measured == whole_files_sha256(directory):
        raise RecipeError(f"--eval {path}: records the weights fingerprint of an older `recipe eval` (sha256 of "
                          f"the whole files); rerun `recipe eval {directory} --json FILE` and pass that file")
    if measured != expected:
        raise RecipeError(f"--eval {path}: measured other weights (sha256 {str(measured)[:12]}…), not this "
                          f"output's ({str(expected)[:12]}…); evaluate this output with recipe eval {directory} "
                          f"--json FILE")
    if model.get("resolved_sha256") != report.recipe.resolved_sha256:
        raise RecipeError(f"--eval {path}: measured an output of another resolved recipe (sha256 "
                          f"{str(model.get('resolved_sha256'))[:12]}…, this output's "
                          f"{report.recipe.resolved_sha256[:12]}…)")
    _check_values(path, record)
    _check_consistency(path, record, directory)
    return record
