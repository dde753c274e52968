"""``recipe apply --resume``: SIGKILL a run between steps, inside a shared pass and while the output is being
written, resume it, and get a model.safetensors byte-identical to an uninterrupted run's; a changed recipe or
model is refused with one line; without ``--resume`` the checkpoints are reported and removed.

The runs are forked by ``tests/resume_driver.py`` (imports paid once).
"""
from __future__ import annotations

import hashlib
import json

import recipe_engine
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import save_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 60
STEPS = ["FuseNorm", "PauseStep", "FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP", "PauseInPass",
         "GPTQ<group_size:32,export:compressed-tensors>"]  # packed: the quantization records are resumed too


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    save_tiny_model(base / "model", num_hidden_layers=6)
    (base / "cal.txt").write_text(TEXT)
    recipe = {"version": 1, "name": "resume", "model": str(base / "model"), "output": str(base / "out" / "x"),
              "dtype": "float32", "modifiers": STEPS,
              "calibration": {"dataset": str(base / "cal.txt"), "samples": 8, "seq_len": 32, "batch_size": 2}}
    (base / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))

    def apply(name, output, *extra):
        return {"name": name, "argv": ["apply", str(base / "recipe.yaml"), "--output", str(base / "out" / output),
                                       "--quiet", *extra]}

    cases = [apply("reference", "reference")]
    for point in ("step", "pass", "writing"):
        cases.append({**apply(f"kill_{point}", point), "pause": point,
                      "then": [apply(f"resume_{point}", point, "--resume")]})
    cases.append({**apply("kill_refused", "refused"), "pause": "pass", "then": [
        apply("changed_recipe", "refused", "--resume", "--set", "modifiers.4.lambda_scale=5"),
        {**apply("changed_model", "refused", "--resume"), "touch": str(base / "model" / "model.safetensors")},
        apply("start_over", "refused")]})
    (base / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    driver = Path(__file__).with_name("resume_driver.py")
    # generous timeout: the shared CI machine may be loaded
    subprocess.run([sys.executable, str(driver), str(base / "cases.json")], env=env, check=True, timeout=900)
    return base


def rc(base: Path, name: str) -> int:
    return int((base / f"{name}.rc").read_text())


@pytest.mark.parametrize("point,reached", [("step", {"group": 1, "layer": None}),
                                           ("pass", {"group": 3, "layer": 1}),
                                           ("writing", {"group": 4, "layer": None})])
def test_killed_then_resumed_equals_an_uninterrupted_run(runs, point, reached):
    assert rc(runs, "reference") == 0
    assert rc(runs, f"kill_{point}") == -9
    assert rc(runs, f"resume_{point}") == 0, (runs / f"resume_{point}.err").read_text()
    out = runs / "out" / point
    assert sha256(out / "model.safetensors") == sha256(runs / "out" / "reference" / "model.safetensors")
    report = recipe_engine.load_report(out)
    assert report.resumed.model_dump() == reached
    reference = recipe_engine.load_report(runs / "out" / "reference")
    assert [s.modifier for s in report.steps] == [s.modifier for s in reference.steps]
    assert report.after == reference.after
    if point == "pass":  # the finished layers were not run again
        assert report.calibration_layer_runs < reference.calibration_layer_runs
    leftovers = [p.name for p in (runs / "out").iterdir() if p.name.startswith(f".{point}.")]
    assert leftovers == []  # checkpoints removed after success; the killed run's temporary dir swept


def test_a_changed_recipe_or_model_is_refused_and_a_plain_run_starts_over(runs):
    assert rc(runs, "kill_refused") == -9
    errors = [line for line in (runs / "changed_recipe.err").read_text().splitlines() if line.startswith("error")]
    assert rc(runs, "changed_recipe") == 2 and len(errors) == 1  # (the other line: the swept temporary dir)
    assert "cannot resume: the resolved recipe changed (sha256 " in errors[0]
    errors = [line for line in (runs / "changed_model.err").read_text().splitlines() if line.startswith("error")]
    assert rc(runs, "changed_model") == 2 and len(errors) == 1
    assert "cannot resume: the model source changed (sha256 " in errors[0]
    assert rc(runs, "start_over") == 0
    assert "note: removing the checkpoints of an interrupted run" in (runs / "start_over.err").read_text()
    assert not (runs / "out" / ".refused.resume").exists()
