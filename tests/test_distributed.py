"""Data-parallel calibration (recipe_engine.execution.distributed): 2 gloo processes vs 1 process on tiny models.

Two ranks (``tests/dp_driver.py``) run every job of one launch; the same recipes run here in one process.
The outputs must agree (fp64-reduced statistics: max relative weight difference ≤ 1e-6 per tensor) and so
must every choice the steps report (merged/removed layers, kept head groups, ...), compared field by field.
A rank that raises stops both with one line, exit != 0, nothing written.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import recipe_engine
from tests.helpers import save_tiny_model, spawn_two_ranks

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 60

#: job name → (steps, calibration samples); batch_size 2, so 6 samples = 3 batches, split 1 + 2.
JOBS = {
    "flattengpt": (["FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"], 8),
    "shortgpt": (["ShortGPT<n:2>"], 6),
    "sleb": (["SLEB<n:2>"], 8),
    "gptq": (["GPTQ<group_size:32>"], 8),
    "gptq_onepass": (["GPTQ<group_size:32,sequential:false>"], 8),
    "widthprune": (["WidthPrune<kv_groups_keep:1,criterion:fluctuation>"], 6),  # FLAP: its mean reduced too
}
#: Jobs only run data-parallel: LoRARecovery trains with the HF Trainer's DDP (a different data order than
#: one process, so not compared with it); the ranks' checksums must still agree.
TRAINER = {"lora": ["ShortGPT<n:1>", "LoRARecovery<max_steps:2,batch_size:4,micro_batch_size:2,seq_len:32,lr:0.01>"]}
FAILING = {"fail_model_step": ["ShortGPT<n:1>", "FailOnRank"], "fail_in_pass": ["FailInPass"]}


def write_recipe(base: Path, name: str, steps: list[str], samples: int, model: Path) -> Path:
    recipe = {"version": 1, "name": name, "model": str(model), "output": str(base / "out" / name),
              "dtype": "float32", "modifiers": steps,
              "calibration": {"dataset": str(base / "cal.txt"), "samples": samples, "seq_len": 32,
                              "batch_size": 2}}
    path = base / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """Run every job with 2 ranks (one launch) and each passing job in this process; returns the base dir."""
    base = tmp_path_factory.mktemp("dp")
    save_tiny_model(base / "model", num_hidden_layers=6)
    (base / "cal.txt").write_text(TEXT)
    jobs = [{"name": name, "argv": ["apply", str(write_recipe(base, name, steps, samples, base / "model")),
                                    "--quiet"]}
            for name, (steps, samples) in JOBS.items()]
    jobs += [{"name": name, "argv": ["apply", str(write_recipe(base, name, steps, 8, base / "model")), "--quiet"]}
             for name, steps in {**TRAINER, **FAILING}.items()]
    (base / "jobs.json").write_text(json.dumps(jobs))
    ranks = spawn_two_ranks(base / "jobs.json")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference runs here meanwhile, with the ranks' thread count
    try:
        for name, (steps, samples) in JOBS.items():
            path = write_recipe(base, name, steps, samples, base / "model")
            recipe_engine.apply(str(path), overrides=[f"output={base / 'single' / name}"], progress=False)
    finally:
        torch.set_num_threads(threads)
        codes = [rank.wait(timeout=180) for rank in ranks]
    assert codes == [0, 0]
    return base


def assert_same_choices(dp, single, path="report") -> None:
    """Every non-float value equal, floats within 1e-6 relative (fp64 sums in another order)."""
    if isinstance(single, dict):
        assert dp.keys() == single.keys(), path
        for key in single:
            assert_same_choices(dp[key], single[key], f"{path}.{key}")
    elif isinstance(single, list):
        assert len(dp) == len(single), path
        for k, (a, b) in enumerate(zip(dp, single)):
            assert_same_choices(a, b, f"{path}[{k}]")
    elif isinstance(single, float):
        assert dp == pytest.approx(single, rel=1e-6, abs=1e-9), path
    else:
        assert dp == single, path


@pytest.mark.parametrize("name", sorted(JOBS))
def test_two_ranks_equal_one_process(launch, name):
    dp_dir, single_dir = launch / "out" / name, launch / "single" / name
    for rank in range(2):
        assert (launch / f"{name}.rank{rank}.rc").read_text() == "0"
    dp, single = load_file(dp_dir / "model.safetensors"), load_file(single_dir / "model.safetensors")
    assert dp.keys() == single.keys()
    worst = max(float((dp[k].double() - single[k].double()).abs().max()
                      / single[k].double().abs().max().clamp_min(1e-30))
                for k in single)
    assert worst <= 1e-6
    dp_report, single_report = recipe_engine.load_report(dp_dir), recipe_engine.load_report(single_dir)
    assert dp_report.ranks == 2 and single_report.ranks == 1
    assert_same_choices(dp_report.after.model_dump(), single_report.after.model_dump())
    for a, b in zip(dp_report.steps, single_report.steps):
        assert_same_choices(a.result, b.result, f"step {b.index}")
    if (single_dir / "quantization_log.csv").is_file():  # the rows of the ranks' reduced grams, seconds aside
        numbers = lambda row: {k: float(v) if "error" in k or k == "damping" else v for k, v in row.items()
                               if k != "seconds"}
        rows = lambda d: [numbers(row) for row in csv.DictReader((d / "quantization_log.csv").open())]
        assert_same_choices(rows(dp_dir), rows(single_dir), "quantization_log.csv")
    # the layer runs were split, not repeated: the reduction is exercised
    assert dp_report.calibration_layer_runs == single_report.calibration_layer_runs
    assert dp_report.calibration_layer_batches < single_report.calibration_layer_batches


def test_only_rank_zero_writes(launch):
    """One output per passing job and nothing else: rank 1 wrote no directory of its own."""
    assert sorted(p.name for p in (launch / "out").iterdir()) == sorted([*JOBS, *TRAINER])


def test_lora_recovery_trains_with_ddp_under_the_launch(launch):
    assert [(launch / f"lora.rank{r}.rc").read_text() for r in range(2)] == ["0", "0"]
    report = recipe_engine.load_report(launch / "out" / "lora")
    lora = report.steps[1].result
    assert lora["processes"] == 2 and lora["steps"] == 2 and report.after.layers == 5


@pytest.mark.parametrize("name", sorted(FAILING))
def test_a_failing_rank_stops_both_with_one_line(launch, name):
    rc = [int((launch / f"{name}.rank{r}.rc").read_text()) for r in range(2)]
    err = [(launch / f"{name}.rank{r}.err").read_text() for r in range(2)]
    assert rc[0] == 1 and rc[1] != 0
    assert err[0].count("\n") == 1 and err[0].startswith("error: rank 0: stopped because rank 1 failed:")
    assert "injected failure" in err[0]
    if name == "fail_model_step":  # a recipe error: one line on the failing rank too
        assert rc[1] == 2 and err[1].count("\n") == 1 and "injected failure on rank 1" in err[1]
    assert not (launch / "out" / name).exists()
    assert not [p for p in (launch / "out").iterdir() if p.name.startswith(".")]


def test_plan_shows_per_rank_memory(launch, capsys):
    from recipe_engine.cli import main

    recipe = str(launch / "flattengpt.yaml")
    assert main(["plan", recipe, "--json", "--ranks", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    per_rank = plan["data_parallel"]
    one_set = 8 * 32 * 64 * 4  # samples × seq_len × hidden × fp32: the gathered outputs of one layer
    assert per_rank["ranks"] == 2 and per_rank["batches_per_rank"] == 2
    assert per_rank["gather_bytes"] == one_set * 2  # the gathered set plus this rank's share twice
    assert per_rank["activations_bytes"] == plan["memory"]["activations_bytes"]  # replicated, not divided
    assert per_rank["host_peak_bytes_all_ranks"] == 2 * per_rank["host_peak_bytes_per_rank"]
    assert main(["plan", recipe, "--ranks", "2"]) == 0
    assert "data-parallel over 2 ranks" in capsys.readouterr().out
