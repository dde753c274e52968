"""GPTQ on every expert of a Qwen3-30B-A3B-shaped mixture-of-experts checkpoint: per-layer time and peak memory
against ``recipe plan``'s estimate.

    OMP_NUM_THREADS=2 python -m benchmarks.moe_gptq --work /tmp/moe --layers 2 --samples 8 --seq-len 512

The checkpoint is synthetic bf16 (random weights, std 0.02, written by ``save_pretrained`` with the Hub's
per-expert names): Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of width 768, top-8, 32 query / 4 KV
heads of 128) with ``--layers`` of its 48 layers, and SmolLM2's tokenizer and vocabulary (49152; the original's
151936 only changes the embeddings). Calibration: WikiText-2 validation windows (timing only). The recipe is
``GPTQ<bits:4,group_size:128,export:dequantized>`` on every linear and expert. Printed as JSON:

- ``layers``: each layer's seconds by phase from the run's timings log (``compress``: the Hessians and solves);
  ``solve_seconds_by_layer``: the sums of ``quantization_log.csv``'s ``seconds`` (the solves alone);
- ``extrapolated_48_s``: the first layer plus 47 times the last (the steady pace);
- ``peak_host_bytes``: the run's high-water mark (its report: anonymous and file-backed pages together);
  ``peak_anonymous_bytes`` and ``file_backed_at_peak_bytes``: ``/proc/PID/status``'s ``RssAnon`` at its
  largest and ``RssFile`` then, sampled every 0.2 s (the memory-mapped checkpoint's pages are file-backed and
  reclaimable; the plan counts the anonymous memory); the samples are kept in ``WORK/host_memory.json``
  (``unix_s`` lines them up with the timings log's);
- ``plan_host_bytes``: ``recipe plan --json``'s host peak (before loading), ``run_plan_host_bytes``: the
  run's own estimate (its report: the runtime measured after loading).
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

from benchmarks.acceptance.moe import QWEN3_30B_A3B, write_moe_checkpoint

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
    child = subprocess.Popen([*cli, "apply", str(path), "--force"])
    anonymous, file_backed, timeline = 0, 0, []
    while child.poll() is None:
        status = memory_status(child.pid)
        now_anonymous, now_file_backed = status.get("RssAnon", 0), status.get("RssFile", 0)
        timeline.append([round(time.time(), 2), now_anonymous >> 20, now_file_backed >> 20])
        if now_anonymous > anonymous:
            anonymous, file_backed = now_anonymous, now_file_backed
        time.sleep(0.2)
    (args.work / "host_memory.json").write_text(json.dumps({"columns": ["unix_s", "anon_mib", "file_mib"],
                                                            "samples": timeline}))
    if child.returncode:
        sys.exit(f"recipe apply exited with {child.returncode}")
    wall = time.perf_counter() - started
    import recipe_engine

    report = recipe_engine.load_report(args.work / "out")
    solve_seconds = defaultdict(float)
    with open(args.work / "out" / "quantization_log.csv") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        kind = "experts" if "experts." in row["module"] else "attention"
        solve_seconds[int(row["layer"]), kind] += float(row["seconds"])
    records = [json.loads(line) for line in (args.work / "out" / "timings.jsonl").read_text().splitlines()]
    layers = [{"layer": r["layer"], "seconds": round(sum(r["seconds"].values()), 1),
               "phases": {k: round(v, 1) for k, v in r["seconds"].items()}} for r in records if "layer" in r]
    written = [r["seconds"].get("write", 0.0) for r in records if r.get("event") == "output written"]
    print(json.dumps({
        "wall_s": round(wall, 1), "layers": layers,
        "extrapolated_48_s": round(layers[0]["seconds"] + 47 * layers[-1]["seconds"], 0),
        "output_written_s": round(sum(written), 1),
        "solve_seconds_by_layer": {f"{k[0]} {k[1]}": round(v, 1) for k, v in sorted(solve_seconds.items())},
        "peak_host_bytes": int(report.peak_memory.rss_mib * 2**20),
        "peak_anonymous_bytes": anonymous, "file_backed_at_peak_bytes": file_backed,
        "plan_host_bytes": plan["memory"]["host_peak_bytes"],
        "run_plan_host_bytes": (int(report.peak_memory.estimate_rss_mib * 2**20)
                                if report.peak_memory.estimate_rss_mib else None),
        "rows": len(rows), "threads": os.environ.get("OMP_NUM_THREADS")}, indent=1))


def memory_status(pid: int) -> dict[str, int]:
    """``/proc/PID/status``'s memory lines in bytes (empty once the process is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {key: int(value.split()[0]) * 1024 for key, value in (line.split(":", 1) for line in lines)
            if value.strip().endswith("kB")}


if __name__ == "__main__":
    main()
