"""``recipe apply --resume``: SIGKILL a run between steps, inside a shared pass and while the output is being
written, resume it, and get a model.safetensors byte-identical to an uninterrupted run's; a changed recipe or
model is refused with one line; without ``--resume`` the checkpoints are reported and removed. The same for
streamed runs (their staged units are the checkpoint; restoring materializes nothing) and for data-parallel
runs (2 gloo ranks, both SIGKILLed; rank 0 writes the checkpoints, every rank restores them).

The runs are forked by ``tests/resume_driver.py`` (imports paid once); the 2-rank launches run
``tests/dp_driver.py``.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recipe_engine.execution.resume import resume_directory
from tests.helpers import free_port, save_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 60
STEPS = ["FuseNorm", "PauseStep", "FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP", "PauseInPass",
         "GPTQ<group_size:32,export:compressed-tensors>"]  # packed: the quantization records are resumed too


STREAMED = ("--set", "stream='on'")  # quoted: YAML reads a bare on as true
#: In memory, and streamed (the model a meta skeleton, changed units staged: the staged files are the checkpoint).
MODES = {"memory": (), "streamed": STREAMED}


ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_recipe(base: Path) -> None:
    save_tiny_model(base / "model", num_hidden_layers=6)
    (base / "cal.txt").write_text(TEXT)
    recipe = {"version": 1, "name": "resume", "model": str(base / "model"), "output": str(base / "out" / "x"),
              "dtype": "float32", "modifiers": STEPS,
              "calibration": {"dataset": str(base / "cal.txt"), "samples": 8, "seq_len": 32, "batch_size": 2}}
    (base / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    write_recipe(base)

    def apply(name, output, *extra):
        return {"name": name, "argv": ["apply", str(base / "recipe.yaml"), "--output", str(base / "out" / output),
                                       "--quiet", "--checkpoint-budget", "1", *extra]}  # every layer

    cases = []
    for mode, extra in MODES.items():
        cases.append(apply(f"{mode}_reference", f"{mode}_reference", *extra))
        for point in ("step", "pass", "writing"):
            cases.append({**apply(f"{mode}_kill_{point}", f"{mode}_{point}", *extra), "pause": point,
                          "then": [apply(f"{mode}_resume_{point}", f"{mode}_{point}", "--resume", *extra)]})
    cases.append({**apply("streamed_kill_refused", "streamed_refused", *STREAMED), "pause": "pass", "then": [
        apply("streamed_changed_recipe", "streamed_refused", "--resume", *STREAMED, "--set",
              "modifiers.4.lambda_scale=5")]})
    auto = ("--set", "stream=auto")
    cases.append({**apply("auto_kill", "auto", *auto), "env": {"RECIPE_TEST_AUTO_STREAMS": "yes"}, "pause": "pass",
                  "then": [{**apply("auto_in_memory", "auto", "--resume", *auto),
                            "env": {"RECIPE_TEST_AUTO_STREAMS": "no"}}]})
    cases.append({**apply("kill_refused", "refused"), "pause": "pass", "then": [
        apply("changed_recipe", "refused", "--resume", "--set", "modifiers.4.lambda_scale=5"),
        {**apply("changed_model", "refused", "--resume"), "touch": str(base / "model" / "model.safetensors")},
        apply("start_over", "refused")]})
    no_checkpoints = (*STREAMED, "--no-checkpoints")
    cases.append({**apply("no_checkpoints_kill", "no_checkpoints", *no_checkpoints), "pause": "pass",
                  "then": [apply("no_checkpoints_rerun", "no_checkpoints", *no_checkpoints),
                           apply("no_checkpoints_resume", "no_checkpoints_resume", "--resume", *no_checkpoints)]})
    (base / "cases.json").write_text(json.dumps(cases))
    driver = Path(__file__).with_name("resume_driver.py")
    # generous timeout: the shared CI machine may be loaded
    subprocess.run([sys.executable, str(driver), str(base / "cases.json")], env=ENV, check=True, timeout=900)
    return base


def rc(base: Path, name: str) -> int:
    return int((base / f"{name}.rc").read_text())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("point,reached", [("step", {"group": 1, "layer": None}),
                                           ("pass", {"group": 3, "layer": 1}),
                                           ("writing", {"group": 4, "layer": None})])
def test_killed_then_resumed_equals_an_uninterrupted_run(runs, mode, point, reached):
    assert rc(runs, f"{mode}_reference") == 0
    assert rc(runs, f"{mode}_kill_{point}") == -9
    assert rc(runs, f"{mode}_resume_{point}") == 0, (runs / f"{mode}_resume_{point}.err").read_text()
    out = runs / "out" / f"{mode}_{point}"
    expected = sha256(runs / "out" / "memory_reference" / "model.safetensors")  # streamed equals in memory
    assert sha256(runs / "out" / f"{mode}_reference" / "model.safetensors") == expected
    assert sha256(out / "model.safetensors") == expected
    report = json.loads((out / "report.json").read_text())
    assert report["resumed"] == reached and report["streamed"] is (mode == "streamed")
    reference = json.loads((runs / "out" / f"{mode}_reference" / "report.json").read_text())
    assert [s["modifier"] for s in report["steps"]] == [s["modifier"] for s in reference["steps"]]
    assert report["after"] == reference["after"]
    log = lambda directory: [line.rsplit(",", 1)[0]  # seconds aside
                             for line in (directory / "quantization_log.csv").read_text().splitlines()]
    assert log(out) == log(runs / "out" / f"{mode}_reference")  # every layer's row once
    if point == "pass":  # the finished layers were not run again
        assert report["calibration_layer_runs"] < reference["calibration_layer_runs"]
    leftovers = [p.name for p in (runs / "out").iterdir() if p.name.startswith(f".{mode}_{point}.")]
    assert leftovers == []  # checkpoints removed after success; the killed run's temporary dir swept


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("point", ["step", "pass", "writing"])
def test_a_resumed_run_writes_the_uninterrupted_runs_config_json(runs, mode, point):
    """config.json (and generation_config.json) byte for byte, whichever checkpoint the run resumed from (the
    config restored from the manifest; ``writing``: killed after the configs were written once). The steps
    change the config (layers, heads, intermediate size, tied embeddings, the packed format's
    quantization_config), so restoring has to set values; a value set from the manifest's JSON where no step
    changed it (``id2label``, whose int keys JSON makes strings) gave config.json a block the reference lacks."""
    assert rc(runs, f"{mode}_resume_{point}") == 0, (runs / f"{mode}_resume_{point}.err").read_text()
    reference, resumed = runs / "out" / f"{mode}_reference", runs / "out" / f"{mode}_{point}"
    source = json.loads((runs / "model" / "config.json").read_text())
    config = json.loads((reference / "config.json").read_text())
    assert config["num_hidden_layers"] < source["num_hidden_layers"] and "quantization_config" in config
    assert "id2label" not in config
    for name in ("config.json", "generation_config.json"):
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.mark.parametrize("point", ["step", "pass", "writing"])
def test_a_streamed_checkpoint_is_the_staged_units_and_restores_nothing_into_memory(runs, point):
    """The killed streamed run staged its changed units in the checkpoint directory (no second copy, no
    staging directory in its temporary output); a unit no step changed stays at home in the source; the
    resumed run restored every unit as a meta tensor (nothing materialized to restore)."""
    killed = json.loads((runs / f"streamed_kill_{point}.checkpoint.json").read_text())
    homes = [entry["home"] for entry in killed["layers"]] + killed["rest"]
    staged = sorted(h["file"] for h in homes if h["file"])
    assert staged and len(set(staged)) == len(staged)
    assert all(name.startswith("unit-") for name in staged)
    assert {h["file"] for h in homes} - set(staged) == {None}  # e.g. the embeddings: the source's
    assert killed["unit_files"] == staged  # no superseded or unnamed unit file was left
    assert killed["staging_in_output"] == []
    restored = json.loads((runs / f"streamed_resume_{point}.restored.json").read_text())
    assert restored == {"streamed": True, "materialized": 0}


def test_a_run_without_checkpoints_keeps_none_and_writes_the_same_bytes(runs):
    """``--no-checkpoints``: killed mid-pass it leaves no resume directory (and no staging data: the swept
    temporary output held it); run again it writes the checkpointed run's bytes; with ``--resume`` it is
    refused in one line before any work."""
    assert rc(runs, "no_checkpoints_kill") == -9
    killed = json.loads((runs / "no_checkpoints_kill.checkpoint.json").read_text())
    assert killed["resume_directory"] is False and killed["staging_in_output"]  # staging lived in the temporary output
    assert rc(runs, "no_checkpoints_rerun") == 0, (runs / "no_checkpoints_rerun.err").read_text()
    assert sha256(runs / "out" / "no_checkpoints" / "model.safetensors") == \
        sha256(runs / "out" / "streamed_reference" / "model.safetensors")
    assert [p.name for p in (runs / "out").iterdir() if p.name.startswith(".no_checkpoints")] == []
    errors = [line for line in (runs / "no_checkpoints_resume.err").read_text().splitlines()
              if line.startswith("error")]
    assert rc(runs, "no_checkpoints_resume") == 2 and len(errors) == 1
    assert "--resume is not supported for --no-checkpoints (no checkpoints are kept)" in errors[0]
    assert not (runs / "out" / "no_checkpoints_resume").exists()


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


def test_a_streamed_resume_refuses_a_changed_recipe_or_an_in_memory_continuation(runs):
    assert rc(runs, "streamed_kill_refused") == -9
    errors = [line for line in (runs / "streamed_changed_recipe.err").read_text().splitlines()
              if line.startswith("error")]
    assert rc(runs, "streamed_changed_recipe") == 2 and len(errors) == 1
    assert "cannot resume: the resolved recipe changed (sha256 " in errors[0]
    # the same recipe, but stream: auto decides otherwise this time: refused, not silently mixed
    assert rc(runs, "auto_kill") == -9
    errors = [line for line in (runs / "auto_in_memory.err").read_text().splitlines() if line.startswith("error")]
    assert rc(runs, "auto_in_memory") == 2 and len(errors) == 1
    assert "cannot resume: the interrupted run was streamed and this one is not" in errors[0]


# -- data-parallel (torchrun-style: 2 gloo ranks, tests/dp_driver.py) ----------------------------------------
def launch(base: Path, name: str, jobs: list[dict], kill: str | None = None) -> list[int]:
    """One 2-rank launch running ``jobs`` in turn; with ``kill`` (a job), SIGKILL both ranks once rank 0 is at
    that job's pause point. Returns the ranks' exit codes."""
    (base / f"{name}.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    driver = Path(__file__).with_name("dp_driver.py")
    ranks = [subprocess.Popen([sys.executable, str(driver), str(base / f"{name}.json")],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        if kill is not None:
            deadline = time.monotonic() + 600
            while not (base / f"{kill}.rank0.ready").exists():
                if time.monotonic() > deadline or any(rank.poll() is not None for rank in ranks):
                    raise AssertionError(f"{kill} did not reach its pause point: see {kill}.rank*.err")
                time.sleep(0.05)
            for rank in ranks:
                rank.send_signal(signal.SIGKILL)
        return [rank.wait(timeout=600) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """Launches: [uninterrupted, killed mid-pass], [changed recipe refused, resumed, streamed killed between
    steps], [streamed resumed, killed while writing], [resumed]; each kill SIGKILLs both ranks."""
    base = tmp_path_factory.mktemp("dp_resume")
    write_recipe(base)

    def job(name, output, *extra, pause=None):
        argv = ["apply", str(base / "recipe.yaml"), "--output", str(base / "out" / output), "--quiet",
                "--checkpoint-budget", "1", *extra]
        return {"name": name, "argv": argv, **({"pause": pause} if pause else {})}

    codes = {"first": launch(base, "first", [job("reference", "reference"),
                                             job("kill_pass", "pass", pause="pass")], kill="kill_pass")}
    codes["second"] = launch(base, "second", [
        job("changed_recipe", "pass", "--resume", "--set", "modifiers.4.lambda_scale=5"),
        job("resume_pass", "pass", "--resume"),
        job("streamed_kill_step", "streamed_step", *STREAMED, pause="step")], kill="streamed_kill_step")
    codes["third"] = launch(base, "third", [job("streamed_resume_step", "streamed_step", "--resume", *STREAMED),
                                            job("kill_writing", "writing", pause="writing")], kill="kill_writing")
    codes["fourth"] = launch(base, "fourth", [job("resume_writing", "writing", "--resume"),
                                              job("oom_rank1", "oom", pause="out of memory on rank 1"),
                                              job("resume_oom", "oom", "--resume")])
    (base / "codes.json").write_text(json.dumps(codes))
    return base


def dp_rc(base: Path, name: str) -> list[int]:
    return [int((base / f"{name}.rank{r}.rc").read_text()) for r in range(2)]


@pytest.mark.parametrize("name,output,reached", [("resume_pass", "pass", {"group": 3, "layer": 1}),
                                                 ("streamed_resume_step", "streamed_step", {"group": 1, "layer": None}),
                                                 ("resume_writing", "writing", {"group": 4, "layer": None})])
def test_a_killed_data_parallel_run_resumes_on_every_rank_to_the_same_bytes(dp_runs, name, output, reached):
    codes = json.loads((dp_runs / "codes.json").read_text())
    assert codes == {"first": [-9, -9], "second": [-9, -9], "third": [-9, -9], "fourth": [0, 0]}
    assert dp_rc(dp_runs, "reference") == [0, 0]
    assert dp_rc(dp_runs, name) == [0, 0], (dp_runs / f"{name}.rank1.err").read_text()
    out = dp_runs / "out" / output
    assert sha256(out / "model.safetensors") == sha256(dp_runs / "out" / "reference" / "model.safetensors")
    report = json.loads((out / "report.json").read_text())
    assert report["resumed"] == reached and report["ranks"] == 2
    assert report["streamed"] is output.startswith("streamed")
    if name == "resume_pass":  # the finished layers were not run again
        reference = json.loads((dp_runs / "out" / "reference" / "report.json").read_text())
        assert report["calibration_layer_runs"] < reference["calibration_layer_runs"]
    assert not resume_directory(str(out)).exists()  # removed once the output is in place


def test_a_rank_out_of_memory_keeps_rank_0s_checkpoints_and_the_run_resumes(dp_runs):
    """Rank 1 runs out of GPU memory in the pass (layer 2): it says so in one line (exit 4), rank 0 stops at its
    next collective (exit 1) naming it and keeps the checkpoints, and ``--resume`` on both ranks goes on after
    layer 1 to the uninterrupted run's bytes."""
    assert dp_rc(dp_runs, "oom_rank1") == [1, 4]
    rank0, rank1 = ([line for line in (dp_runs / f"oom_rank1.rank{r}.err").read_text().splitlines()
                     if line.startswith("error")] for r in range(2))
    assert len(rank1) == 1 and rank1[0].startswith(
        "error: out of GPU memory during [step 3: HeadPrune, NystromMLP, PauseInPass, GPTQ] layer-sequential pass "
        "3/4: CUDA out of memory. Tried to allocate 2.00 GiB; the resume checkpoints are kept"), rank1
    assert len(rank0) == 1 and rank0[0].startswith("error: rank 0: stopped because rank 1 failed: OutOfMemory: out "
                                                   "of GPU memory during"), rank0
    assert dp_rc(dp_runs, "resume_oom") == [0, 0], (dp_runs / "resume_oom.rank0.err").read_text()
    out = dp_runs / "out" / "oom"
    assert sha256(out / "model.safetensors") == sha256(dp_runs / "out" / "reference" / "model.safetensors")
    assert json.loads((out / "report.json").read_text())["resumed"] == {"group": 3, "layer": 1}


def test_a_data_parallel_resume_refuses_a_changed_recipe_on_every_rank(dp_runs):
    assert dp_rc(dp_runs, "changed_recipe") == [2, 2]
    for rank in range(2):
        errors = [line for line in (dp_runs / f"changed_recipe.rank{rank}.err").read_text().splitlines()
                  if line.startswith("error")]
        assert len(errors) == 1 and "cannot resume: the resolved recipe changed (sha256 " in errors[0]


def test_ranks_that_adopted_different_checkpoints_are_refused(tmp_path):
    """``Checkpoints.agree``: each rank's manifest sha256 is gathered (``Parallel.map`` with one item per
    rank); a rank that saw another checkpoint, or none (no shared file system), stops the run with one line."""
    from recipe_engine.errors import RecipeError
    from recipe_engine.execution.resume import Checkpoints

    class TwoRanks:  # what Parallel.map returns on every rank: rank r's result at position r
        world = 2

        def __init__(self, other: str | None):
            self.other = other

        def map(self, function, items):
            return [function(items[0]), self.other or "none"]

    checkpoints = Checkpoints(tmp_path / ".x.resume", {})
    checkpoints.manifest_sha = "a" * 64
    checkpoints.agree(TwoRanks("a" * 64))  # the same manifest: no error
    for other in ("b" * 64, None):
        with pytest.raises(RecipeError, match=r"cannot resume: ranks \[1\] see another checkpoint in .* than rank 0"):
            checkpoints.agree(TwoRanks(other))


def test_a_run_keeping_resume_checkpoints_needs_room_for_them_too(monkeypatch):
    """Checkpoints (a streamed run's staged units among them) hold the changed units until the output is in
    place: the free-space check asks for twice the output's size, and says so."""
    from transformers import LlamaConfig

    from recipe_engine.paths import output
    from recipe_engine.plan.preflight import check_free_space
    from recipe_engine.errors import RecipeError
    from recipe_engine.plan.compiled import compile_plan
    from recipe_engine.plan.estimates import output_bytes
    from recipe_engine.recipe.schema import recipe_from_dict

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    recipe = recipe_from_dict({"version": 1, "name": "x", "model": "m", "output": "/tmp/x-out",
                               "dtype": "float32", "modifiers": ["FuseNorm"]})
    size = output_bytes(recipe, config)
    real = output.shutil.disk_usage
    monkeypatch.setattr(output.shutil, "disk_usage", lambda p: real(p)._replace(free=int(1.05 * 1.5 * size) + 2**20))
    plan = compile_plan(recipe, config)
    check_free_space(plan)
    with pytest.raises(RecipeError, match="not enough disk space .* checkpoint and its resume checkpoints; "
                                          "--no-checkpoints needs half"):
        check_free_space(plan, resume_checkpoints=True)


def test_the_checkpoint_budget_skips_layer_checkpoints_that_cost_more_than_their_share():
    """A layer checkpoint is due once the work since the last one is (1 − b)/b times its cost: with b = 0.1
    a 2 s checkpoint waits 18 s of work; b = 1 checkpoints every layer; the first one is always due."""
    from recipe_engine.execution.resume import DEFAULT_CHECKPOINT_BUDGET, Checkpoints

    checkpoints = Checkpoints(Path("/nonexistent/.x.resume"), {})
    assert checkpoints.budget == DEFAULT_CHECKPOINT_BUDGET == 0.1 and checkpoints.due(0.0)
    checkpoints._last_end, checkpoints._last_cost = 100.0, 2.0
    assert not checkpoints.due(117.9) and checkpoints.due(118.0)
    checkpoints.budget = 0.5
    assert not checkpoints.due(101.9) and checkpoints.due(102.0)
    checkpoints.budget = 1.0
    assert checkpoints.due(100.0)


def test_a_budgeted_run_skips_costly_layer_checkpoints_and_writes_the_same_model(tmp_path, monkeypatch, capsys):
    """When each layer checkpoint costs far more than a layer (here made slow), the default budget skips
    most of them (report.json counts them) and the output is byte-identical to a run checkpointing every
    layer; ``--checkpoint-budget`` outside (0, 1] is one line from argparse."""
    import recipe_engine
    from recipe_engine.cli import main

    save_tiny_model(tmp_path / "model", num_hidden_layers=6)
    (tmp_path / "cal.txt").write_text(TEXT)
    from recipe_engine.execution.checkpoint_files import CheckpointFiles

    store = CheckpointFiles.store

    def slow_store(self, tensors, prefix):
        time.sleep(0.3)
        return store(self, tensors, prefix)
    monkeypatch.setattr(CheckpointFiles, "store", slow_store)
    reports = {}
    for budget in (1.0, 0.1):
        recipe = {"version": 1, "name": "b", "model": str(tmp_path / "model"), "output": str(tmp_path / f"out{budget}"),
                  "dtype": "float32", "modifiers": ["FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"],
                  "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2}}
        _, reports[budget] = recipe_engine.apply(recipe, progress=False, checkpoints=budget)
    every, budgeted = reports[1.0].checkpoints, reports[0.1].checkpoints
    assert every.skipped == 0 and budgeted.skipped >= 2 and budgeted.written < every.written
    assert sha256(tmp_path / "out1.0" / "model.safetensors") == sha256(tmp_path / "out0.1" / "model.safetensors")
    assert main(["apply", str(tmp_path / "x.yaml"), "--checkpoint-budget", "0"]) == 2
    assert "--checkpoint-budget: expected a number in (0, 1], got 0" in capsys.readouterr().err
