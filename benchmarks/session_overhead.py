"""Session overhead on SmolLM2: a FuseNorm recipe and a layer-sequential pass vs one plain forward.

Each measurement runs in its own child process (peak RSS is per process), in alternating order, and the
table reports medians and ratios against the plain forward pass over the same calibration tokens.

    python -m benchmarks.session_overhead [--samples 32 --seq-len 512 --repeats 3]
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("plain_forward", "layer_pass", "fusenorm_recipe")


def child(mode: str, samples: int, seq_len: int) -> dict:
    import torch

    import recipe_engine
    from recipe_engine.architectures.adapters import adapter_for
    from recipe_engine.sources.text import load_text
    from recipe_engine.sources.windows import sample_windows, tokenize
    from recipe_engine.sources.models import load_model
    from recipe_engine.recipe.schema import CalibrationConfig
    from recipe_engine.execution.context import RunContext
    from recipe_engine.execution.session import Session

    torch.manual_seed(0)
    model, tokenizer, _ = load_model("smollm2-135m")
    config = CalibrationConfig(dataset="wikipedia-sample", samples=samples, seq_len=seq_len)
    text = load_text("wikipedia-sample", "train").text
    windows = sample_windows(tokenize(tokenizer, text), samples, seq_len, 0, "wiki")
    start = time.perf_counter()
    with torch.no_grad():
        if mode == "plain_forward":
            for batch in windows.split(config.batch_size):
                model(input_ids=batch, use_cache=False)
        elif mode == "layer_pass":
            context = RunContext(tokenizer, adapter_for(model.config), config, torch.device("cpu"))
            session = Session(context, model, windows)
            session.pipeline.layer_pass(lambda *_: None)
        else:
            recipe = {"version": 1, "name": "overhead", "model": "smollm2-135m", "output": "unused",
                      "calibration": config.model_dump(), "modifiers": ["FuseNorm"]}
            recipe_engine.apply(recipe, model=model, tokenizer=tokenizer, write=False, progress=False)
    wall = time.perf_counter() - start
    return {"mode": mode, "wall_s": wall, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child")
    parser.add_argument("--json", default="benchmarks/results/raw/session_overhead.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.samples, args.seq_len)))
        return
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        order = MODES if repeat % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--samples", str(args.samples),
                                  "--seq-len", str(args.seq_len)], check=True, capture_output=True, text=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base_wall = statistics.median(r["wall_s"] for r in runs["plain_forward"])
    base_rss = statistics.median(r["peak_rss_mib"] for r in runs["plain_forward"])
    rows = []
    print(f"SmolLM2-135M, {args.samples} x {args.seq_len} calibration tokens, median of {args.repeats}, "
          f"{platform.processor() or platform.machine()}")
    print(f"{'mode':<18}{'wall s':>10}{'ratio':>8}{'peak RSS MiB':>14}{'ratio':>8}")
    for mode in MODES:
        wall = statistics.median(r["wall_s"] for r in runs[mode])
        rss = statistics.median(r["peak_rss_mib"] for r in runs[mode])
        rows.append({"mode": mode, "wall_s": wall, "wall_ratio": wall / base_wall, "peak_rss_mib": rss,
                     "rss_ratio": rss / base_rss})
        print(f"{mode:<18}{wall:>10.2f}{wall / base_wall:>8.2f}{rss:>14.0f}{rss / base_rss:>8.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
