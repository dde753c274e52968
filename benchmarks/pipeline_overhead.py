"""What the layer pipeline costs beyond its compute, on CPU (no GPU needed): how host-side costs are found
and removed between GPU leases.

    python -m benchmarks.pipeline_overhead [--threads 2] [--parts smollm2 stream8b]

smollm2   `recipes/flatten20_smollm2.yaml`'s steps (FuseNorm, FlattenAdjacent, HeadPrune, NystromMLP; 32 × 512
          Wikipedia-sample tokens; no evaluation) against one plain forward of the model (`model(batch)`,
          lm_head included) over the same tokens, each in its own process at ``--threads``: the ratio of the
          steps' wall time to the forward's (goal ≤ 3.0), and the run's seconds by phase per step from its
          timings log.
stream8b  the streamed Llama-3-8B-shaped recipe (`FlattenAdjacent<n:1>, HeadPrune, NystromMLP,
          GPTQ<bits:4,group_size:128>`) on 4 of its layers in bf16 at 4 × 512 tokens, under torch.profiler:
          for each step, the share of its wall time spent outside compute kernels (goal ≤ 15 %): Python,
          loading and writing weights, and copies and conversions (``aten::copy_``, ``aten::_to_copy``,
          ``aten::clone`` and allocations), everything but the self time of the other ATen operations.

A table is printed and the figures are written to benchmarks/results/raw/pipeline_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "benchmarks" / "results" / "raw" / "pipeline_overhead.json"
#: ATen operations that move or convert data rather than compute: counted as host-side work.
NOT_COMPUTE = ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous", "aten::empty",
               "aten::empty_like", "aten::empty_strided", "aten::zeros", "aten::zeros_like", "aten::resize_",
               "aten::detach", "aten::lift_fresh", "aten::_local_scalar_dense", "aten::item")
GOAL_STEPS_OVER_FORWARD = 3.0
GOAL_HOST_SHARE = 0.15


# -- children ------------------------------------------------------------------------------------------
def child_forward(samples: int, seq_len: int) -> dict:
    import torch

    from recipe_engine.sources.text import load_text
    from recipe_engine.sources.windows import sample_windows, tokenize
    from recipe_engine.sources.models import load_model

    model, tokenizer, _ = load_model("smollm2-135m")
    windows = sample_windows(tokenize(tokenizer, load_text("wikipedia-sample", "train").text), samples, seq_len,
                             0, "wiki")
    started = time.perf_counter()
    with torch.no_grad():
        for batch in windows.split(4):
            model(input_ids=batch, use_cache=False)
    return {"forward_s": time.perf_counter() - started}


def child_recipe(work: str) -> dict:
    import yaml

    import recipe_engine
    from recipe_engine.execution.timings import read_timings, summarize

    recipe = yaml.safe_load((ROOT / "recipes" / "flatten20_smollm2.yaml").read_text())
    recipe.update(evaluate=None, output=str(Path(work) / "out"))
    _, report = recipe_engine.apply(recipe, force=True, progress=False, checkpoints=False)
    steps_s = sum(step.wall_s for step in report.steps) + sum(
        {step.group: step.pass_shared_s for step in report.steps}.values())
    return {"steps_s": steps_s, "steps": {f"{s.index} {s.modifier}": round(s.wall_s, 2) for s in report.steps},
            "phases": summarize(read_timings(Path(work) / "out" / "timings.jsonl"))}


def child_stream8b(work: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import recipe_engine
    from benchmarks import scale

    model = scale.write_synthetic(Path(work) / "llama3-8b-4", 4, torch.bfloat16, **scale.LLAMA3_8B)
    recipe = {"version": 1, "name": "overhead8b", "model": str(model), "dtype": "bfloat16", "stream": "on",
              "calibration": {"dataset": "wikipedia-sample", "samples": 4, "seq_len": 512, "batch_size": 4},
              "modifiers": ["FlattenAdjacent<n:1>", "HeadPrune", "NystromMLP", "GPTQ<bits:4,group_size:128>"],
              "output": str(Path(work) / "out8b")}
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        recipe_engine.apply(recipe, force=True, progress=False, checkpoints=False)
    wall = time.perf_counter() - started
    events = profiler.events()
    steps = [e for e in events if e.name.startswith("recipe step ")]
    out = {}
    for step in steps:
        start, end = step.time_range.start, step.time_range.end
        compute = sum(e.self_cpu_time_total for e in events if e.name.startswith("aten::")
                      and e.name not in NOT_COMPUTE and start <= e.time_range.start and e.time_range.end <= end)
        duration = end - start
        out[step.name.removeprefix("recipe step ")] = {"wall_s": round(duration / 1e6, 2),
                                                         "host_share": round(1 - compute / duration, 3)}
    return {"wall_s": wall, "steps": out}


def run_child(kind: str, threads: int, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, __file__, "--child", kind, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"error: the {kind} child failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- driver ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", nargs="+", choices=("smollm2", "stream8b"), default=["smollm2", "stream8b"])
    parser.add_argument("--child")
    parser.add_argument("args", nargs="*")
    args = parser.parse_args(argv)
    if args.child:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        function = {"forward": lambda: child_forward(32, 512), "recipe": lambda: child_recipe(args.args[0]),
                    "stream8b": lambda: child_stream8b(args.args[0])}[args.child]
        print(json.dumps(function()))
        return 0
    result = {"machine": {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "cpus": os.cpu_count(),
                          "machine": platform.machine(), "command": " ".join(["python", *sys.argv])}}
    lines = []
    with tempfile.TemporaryDirectory(prefix="pipeline-overhead-") as work:
        if "smollm2" in args.parts:
            forward = run_child("forward", args.threads)
            recipe = run_child("recipe", args.threads, work)
            ratio = recipe["steps_s"] / forward["forward_s"]
            result["smollm2"] = {**forward, **recipe, "ratio": round(ratio, 3), "goal": GOAL_STEPS_OVER_FORWARD}
            lines.append(f"SmolLM2 FlattenGPT steps {recipe['steps_s']:.1f} s / plain forward "
                         f"{forward['forward_s']:.1f} s = {ratio:.2f}x (goal <= {GOAL_STEPS_OVER_FORWARD})")
            for step, phases in recipe["phases"].items():
                lines.append(f"  {step or '(writing)':<44} " + "  ".join(f"{k} {v:.1f}" for k, v in phases.items()))
        if "stream8b" in args.parts:
            streamed = run_child("stream8b", args.threads, work)
            result["stream8b"] = {**streamed, "goal": GOAL_HOST_SHARE}
            lines.append(f"8B-shaped, 4 layers, bf16, 4 x 512, streamed: {streamed['wall_s']:.1f} s")
            for step, figures in streamed["steps"].items():
                lines.append(f"  {step:<44} {figures['wall_s']:8.1f} s  host share {figures['host_share']:.1%} "
                             f"(goal <= {GOAL_HOST_SHARE:.0%})")
    RAW.parent.mkdir(parents=True, exist_ok=True)
    RAW.write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    print(f"written: {RAW.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
