"""Speed and size of the FlattenGPT-20% SmolLM2 output against the dense model (``recipe bench``).

    recipe apply recipes/flatten20_smollm2.yaml          # once: writes out/flatten20_smollm2
    nice -n 10 python -m benchmarks.bench_flatten_vs_dense > bench_flatten_vs_dense.log 2>&1

CPU defaults (the paper's GPU protocol is batch 64 × 128 generated tokens and a 2048-token prefill,
``--paper`` restores it): batch 8 × 32 generated tokens, 512-token prefill, 1 warm-up, median of 5
alternated repeats. The output table says how the run differs from the paper.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from recipe_engine.cli import main as recipe

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "raw"   # raw output (ignored by git)


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense", default="smollm2-135m")
    parser.add_argument("--compressed", default=str(ROOT / "out" / "flatten20_smollm2"))
    parser.add_argument("--paper", action="store_true", help="batch 64 × 128 tokens, 2048-token prefill")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a shared CPU)")
    parser.add_argument("--json", default=str(RESULTS / "bench_flatten_vs_dense.json"))
    args = parser.parse_args()
    if not (Path(args.compressed) / "config.json").is_file():
        print(f"{args.compressed} missing: run `recipe apply recipes/flatten20_smollm2.yaml` first", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    sizes = ["--batch", "64", "--gen-tokens", "128", "--prefill-tokens", "2048"] if args.paper else \
        ["--batch", "8", "--gen-tokens", "32", "--prefill-tokens", "512"]
    return recipe(["bench", args.dense, args.compressed, *sizes, "--repeats", str(args.repeats),
                   "--json", args.json])


if __name__ == "__main__":
    sys.exit(run())
