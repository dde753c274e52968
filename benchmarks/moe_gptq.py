"""GPTQ on every expert of a Qwen3-30B-A3B-shaped mixture-of-experts checkpoint: per-layer time and peak memory
against ``recipe plan``'s estimate.

    OMP_NUM_THREADS=2 python benchmarks/moe_gptq.py --work /tmp/moe --layers 2 --samples 8 --seq-len 512

The checkpoint is synthetic bf16 (random weights, std 0.02, written by ``save_pretrained`` with the Hub's
per-expert names): Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of width 768, top-8, 32 query / 4 KV
heads of 128) with ``--layers`` of its 48 layers, and SmolLM2's tokenizer and vocabulary (49152; the original's
151936 only changes the embeddings). Calibration: WikiText-2 validation windows (timing only). The recipe is
``GPTQ<bits:4,group_size:128,export:dequantized>`` on every linear and expert; per-layer seconds are the sums
of ``quantization_log.csv``'s ``seconds`` (the solves and, sequentially, collecting their Hessians), the peak
is the run's peak RSS (its report's high-water mark), the estimate ``recipe plan --json``'s host peak.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from gpu_acceptance_moe import QWEN3_30B_A3B, write_moe_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = write_moe_checkpoint(args.work / f"qwen3-30b-a3b-{args.layers}-bf16", args.layers, "cpu", "smollm2-135m",
                                 QWEN3_30B_A3B)
    data = Path(os.environ.get("RECIPE_DATA_DIR", ROOT / "data")) / "wikitext-2-raw" / "wiki.valid.raw"
    recipe = {"version": 1, "name": "moe-gptq", "model": str(model), "dtype": "bfloat16", "stream": "off",
              "calibration": {"dataset": str(data), "samples": args.samples, "seq_len": args.seq_len,
                              "batch_size": 1},
              "modifiers": ["GPTQ<bits:4,group_size:128,export:dequantized>"], "output": str(args.work / "out")}
    path = args.work / "recipe.json"
    path.write_text(json.dumps(recipe))
    cli = [sys.executable, "-m", "recipe_engine.cli"]
    plan = json.loads(subprocess.run([*cli, "plan", str(path), "--json"], check=True, capture_output=True,
                                     text=True).stdout)
    started = time.perf_counter()
    subprocess.run([*cli, "apply", str(path), "--force"], check=True)
    wall = time.perf_counter() - started
    sys.path.insert(0, str(ROOT))
    import recipe_engine

    # the run's own high-water mark (its report): a child's ru_maxrss starts at this process's resident size
    peak = int(recipe_engine.load_report(args.work / "out").peak_memory.rss_mib * 2**20)
    seconds = defaultdict(float)
    with open(args.work / "out" / "quantization_log.csv") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        kind = "experts" if "experts." in row["module"] else "attention"
        seconds[int(row["layer"]), kind] += float(row["seconds"])
    print(json.dumps({"wall_s": round(wall, 1), "peak_rss_bytes": peak, "plan": {k: v for k, v in plan.items()
                      if "byte" in k or "peak" in k}, "seconds_by_layer": {f"{k[0]} {k[1]}": round(v, 1)
                                                                          for k, v in sorted(seconds.items())},
                      "rows": len(rows), "threads": os.environ.get("OMP_NUM_THREADS")}, indent=1))


if __name__ == "__main__":
    main()
