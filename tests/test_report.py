"""report.json through its pydantic model: written and read back equal, an older format read and upgraded,
a newer or invalid one refused with one line, every field documented in docs/report.md."""
import json
import re
import shutil
from pathlib import Path

import pytest

import recipe_engine
from recipe_engine.records.report import FORMAT_VERSION, Report, ReportError, RunReport, load_report
from tests.helpers import CharTokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[1]
FORMAT0 = Path(__file__).parent / "data" / "report_format0"  # written by the engine before format_version


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("report")
    (tmp_path / "cal.txt").write_text("Report round trip text. " * 200)
    recipe = {"version": 1, "name": "report", "model": "tiny", "output": str(tmp_path / "out"),
              "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4, "seq_len": 16, "batch_size": 2},
              "modifiers": ["FuseNorm", "FlattenAdjacent<n:1>", "HeadPrune", "NystromMLP"],
              "evaluate": {"perplexity": {"dataset": [str(tmp_path / "cal.txt")], "seq_len": 16, "limit": 2}}}
    _, report = recipe_engine.apply(recipe, model=tiny_model(), tokenizer=CharTokenizer(), progress=False)
    return report, tmp_path / "out"


def test_written_report_reads_back_equal(written):
    report, out = written
    assert json.loads((out / "report.json").read_text())["format_version"] == FORMAT_VERSION
    assert load_report(out) == report
    flatten, heads, mlp = report.steps[1:]
    assert heads.group == mlp.group != flatten.group and heads.shared_pass and not flatten.shared_pass
    # NystromMLP's default target: original reads the original model's states, which FlattenAdjacent's pass kept
    # (only FuseNorm, output-preserving, came before it): no second pass of the original model
    assert (flatten.calibration_passes, heads.calibration_passes, mlp.calibration_passes) == (1, 1, 1)
    assert report.calibration_passes == 2 and report.evaluation.quality_gate == "passed"



def test_the_run_report_becomes_the_written_report_and_needs_every_required_section(written):
    """``RunReport`` (the sections a run fills) gives back the same ``Report``; an unset optional section is left
    out (None), an unset required one is a validation error."""
    report, _ = written
    sections = {name: getattr(report, name) for name in ("recipe", "packages", "device", "dtype", "streamed", "rank",
                                                         "ranks")}
    run = RunReport(**sections)
    with pytest.raises(ValueError, match="model"):
        run.to_report()
    for name in ("model", "data", "before", "after", "steps", "stock_checkpoint", "calibration_layer_runs",
                 "calibration_layer_batches", "calibration_passes", "activations_on", "peak_memory", "evaluation",
                 "weights_sha256"):
        setattr(run, name, getattr(report, name))
    assert run.to_report() == report and run.to_report().checkpoints is None

def test_format0_report_is_read_and_upgraded():
    old = json.loads((FORMAT0 / "report.json").read_text())
    assert "format_version" not in old
    report = load_report(FORMAT0)
    assert report.format_version == FORMAT_VERSION and report.calibration_passes is None
    assert [s.modifier for s in report.steps] == [s["modifier"] for s in old["steps"]]
    assert report.steps[2].result == old["steps"][2]["result"]
    assert report.evaluation.before.perplexity.ppl == old["evaluation"]["before"]["perplexity"]["ppl"]


def test_newer_format_is_refused(tmp_path):
    data = json.loads((FORMAT0 / "report.json").read_text())
    (tmp_path / "report.json").write_text(json.dumps({**data, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(ReportError, match=rf"format_version {FORMAT_VERSION + 1} is newer .*upgrade recipe-engine"):
        load_report(tmp_path)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("steps"), r"steps: Field required"),
    (lambda d: d.update(surprise=1), r"surprise: Extra inputs are not permitted"),
    (lambda d: d["before"].update(layers="four"), r"before.layers: Input should be a valid integer"),
])
def test_invalid_report_is_one_line(tmp_path, change, message):
    data = json.loads((FORMAT0 / "report.json").read_text())
    change(data)
    (tmp_path / "report.json").write_text(json.dumps(data))
    with pytest.raises(ReportError, match=message) as caught:
        load_report(tmp_path)
    assert "\n" not in str(caught.value)


def test_missing_report_is_one_line(tmp_path):
    with pytest.raises(ReportError, match=r"cannot read .*report.json"):
        load_report(tmp_path)


def _fields(model) -> set[str]:
    names = set(model.model_fields)
    for field in model.model_fields.values():
        for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
            for inner in (candidate, *getattr(candidate, "__args__", ())):
                if isinstance(inner, type) and issubclass(inner, Report.__mro__[1]) and inner is not model:
                    names |= {f"{n}" for n in _fields(inner)}
    return names


def test_every_field_is_documented():
    documented = set(re.findall(r"`([a-z_0-9]+)`", (ROOT / "docs" / "report.md").read_text()))
    missing = sorted(_fields(Report) - documented)
    assert not missing, f"document in docs/report.md: {missing}"


def test_force_replaces_a_format0_output_only_as_a_recipe_output(tmp_path):
    from recipe_engine.records.report import is_recipe_output

    shutil.copytree(FORMAT0, tmp_path / "old")
    assert not is_recipe_output(tmp_path / "old")  # no recipe.yaml beside it
    (tmp_path / "old" / "recipe.yaml").write_text("version: 1\n")
    assert is_recipe_output(tmp_path / "old")


def test_weights_fingerprint_of_files_that_are_not_safetensors_hashes_each_whole(tmp_path):
    """A weight file whose bytes do not parse as safetensors (too short, a header length past the end, not JSON,
    an empty file) is one segment: sha256 over its name, a NUL and the sha256 of all its bytes."""
    import hashlib

    from recipe_engine.records.fingerprints import weights_fingerprint

    contents = {"a.safetensors": b"", "b.safetensors": b"short", "c.safetensors": (10**6).to_bytes(8, "little"),
                "d.safetensors": (4).to_bytes(8, "little") + b"{not"}
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
    outer = hashlib.sha256()
    for name in sorted(contents):
        outer.update(name.encode() + b"\0" + hashlib.sha256(contents[name]).digest())
    assert weights_fingerprint(tmp_path) == outer.hexdigest()
    assert weights_fingerprint(tmp_path / "none") is None
