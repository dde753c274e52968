"""Data-parallel calibration: 1 process × 1 torch thread vs ``torchrun --nproc-per-node 2`` × 1 thread each.

    nice -n 10 python -m benchmarks.data_parallel [--ranks 2] [--samples 16] [--seq-len 256]

Runs ``recipes/flatten20_smollm2.yaml`` (SmolLM2-135M FlattenGPT) on WikiText-2 validation windows
(``samples × seq_len`` tokens; the recipe's own evaluation is switched off so both runs time calibration and
compression only) twice, back to back: one process with ``OMP_NUM_THREADS=1``, then torchrun with N ranks of
one thread each. Wall time is the whole command (process start, model load, steps, write). Then both outputs
get the same perplexity evaluation (WikiText-2 test, 1024-token windows, ``--ppl-limit`` windows, in this
process) and their weights are compared. Prints a table, writes the raw record to
``benchmarks/results/raw/data_parallel.json`` and the table's rows to the committed
``benchmarks/results/data_parallel.json`` (``python benchmarks/report.py`` renders them into BENCHMARKS.md).
The load average before and after is recorded with the run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import recipe_engine

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "flatten20_smollm2.yaml"


def load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def run(command: list[str], env: dict) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system of the command and every process it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--ppl-limit", type=int, default=24)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="dp-bench-"))
    sets = ["--set", "calibration.dataset=wikitext2", "--set", "calibration.split=validation",
            "--set", f"calibration.samples={args.samples}", "--set", f"calibration.seq_len={args.seq_len}",
            "--set", "evaluate=null", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    load_before = load()
    single, single_cpu = run([sys.executable, "-m", "recipe_engine.cli", "apply", str(RECIPE), "--output",
                  str(base / "single"), *sets], env)
    parallel, parallel_cpu = run([torchrun, "--standalone", f"--nproc-per-node={args.ranks}", "-m", "recipe_engine.cli",
                    "apply", str(RECIPE), "--output", str(base / "parallel"), *sets], env)
    load_after = load()

    import torch
    from safetensors.torch import load_file

    from recipe_engine.sources.text import load_text
    from recipe_engine.evaluation.perplexity import perplexity
    from recipe_engine.sources.models import load_model

    text = load_text("wikitext2", "test").text
    ppl = {}
    for name in ("single", "parallel"):
        model, tokenizer, _ = load_model(str(base / name), "float32")
        ppl[name] = perplexity(model, tokenizer, text, 1024, args.ppl_limit)["ppl"]
    a, b = (load_file(base / name / "model.safetensors") for name in ("single", "parallel"))
    worst = max(float((a[k].double() - b[k].double()).abs().max() / a[k].double().abs().max().clamp_min(1e-30))
                for k in a)
    reports = {name: recipe_engine.load_report(base / name) for name in ("single", "parallel")}
    record = {
        "recipe": str(RECIPE.relative_to(ROOT)), "calibration": f"{args.samples}x{args.seq_len} wikitext2 validation",
        "ranks": args.ranks, "threads_per_process": 1, "wall_s": {"single": single, "parallel": parallel},
        "wall_ratio": parallel / single, "cpu_s": {"single": single_cpu, "parallel_all_ranks": parallel_cpu},
        "cpu_ratio_per_rank": parallel_cpu / args.ranks / single_cpu, "ppl": ppl,
        "ppl_relative_diff": abs(ppl["parallel"] / ppl["single"] - 1),
        "max_relative_weight_diff": worst, "same_layer_origin": reports["single"].after.layer_origin
        == reports["parallel"].after.layer_origin,
        "layer_batches": {n: r.calibration_layer_batches for n, r in reports.items()},
        "single_checkpoint_s": reports["single"].checkpoints.seconds if reports["single"].checkpoints else 0.0,
        "load_average": {"before": load_before, "after": load_after},
        "torch": torch.__version__,
    }
    print(f"{'run':<28}{'wall s':>9}{'CPU s':>9}{'PPL':>10}")
    print(f"{'1 process x 1 thread':<28}{single:>9.1f}{single_cpu:>9.1f}{ppl['single']:>10.3f}")
    print(f"{f'torchrun {args.ranks} ranks x 1 thread':<28}{parallel:>9.1f}{parallel_cpu:>9.1f}"
          f"{ppl['parallel']:>10.3f}")
    print(f"the 1-process run wrote resume checkpoints for {record['single_checkpoint_s']:.1f} s "
          f"(data-parallel runs keep none)")
    print(f"CPU s: 1 process {single_cpu:.1f}, {args.ranks} ranks together {parallel_cpu:.1f} "
          f"(per rank / single: {record['cpu_ratio_per_rank']:.3f})")
    print(f"wall ratio {record['wall_ratio']:.3f} (goal <= 0.6); PPL diff {record['ppl_relative_diff']:.2e} "
          f"(goal <= 5e-3); max relative weight diff {worst:.2e}; load {load_before} -> {load_after}")
    out = ROOT / "benchmarks" / "results" / "raw" / "data_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    write_rows(record, args.ranks)


def write_rows(record: dict, ranks: int) -> None:
    """The committed table rows (benchmarks/results/data_parallel.json), this run as their run."""
    from benchmarks import rowstore

    load = record["load_average"]
    run = rowstore.run_record(f"load average {load['before'][0]} before, {load['after'][0]} after the two runs")
    wall, cpu, ppl, batches = (record[k] for k in ("wall_s", "cpu_s", "ppl", "layer_batches"))
    rows = [
        {"run_": "1 process × 1 thread", "wall": f"{wall['single']:.1f}", "cpu": f"{cpu['single']:.1f}",
         "ppl": f"{ppl['single']:.5f}", "batches": str(batches["single"])},
        {"run_": f"torchrun {ranks} ranks × 1 thread", "wall": f"{wall['parallel']:.1f}",
         "cpu": f"{cpu['parallel_all_ranks']:.1f} ({cpu['parallel_all_ranks'] / ranks:.1f} per rank)",
         "ppl": f"{ppl['parallel']:.5f}", "batches": str(batches["parallel"])},
        {"run_": "ratio", "wall": f"**{record['wall_ratio']:.2f}**",
         "cpu": f"**{record['cpu_ratio_per_rank']:.2f}** per rank / single",
         "ppl": f"rel. diff {record['ppl_relative_diff']:.1e}",
         "batches": f"{batches['parallel'] / batches['single']:.2f}"},
    ]
    columns = [{"key": "run_", "label": "setup"}, {"key": "wall", "label": "wall s"},
               {"key": "cpu", "label": "CPU s (all processes)"}, {"key": "ppl", "label": "PPL"},
               {"key": "batches", "label": "batches run through layers (rank 0)"}]
    for row in rows:
        rowstore.upsert_table_row(ROOT / "benchmarks" / "results" / "data_parallel.json",
                                  "Data-parallel calibration: 1 process against `torchrun --nproc-per-node 2`", row,
                                  run, "run_", section="Scale", order=61, columns=columns)


if __name__ == "__main__":
    main()
