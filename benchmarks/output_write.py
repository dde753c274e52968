"""How long `recipe apply` takes to write its output, for one or more engines side by side.

A streamed `ShortGPT<n:1>` of a synthetic bf16 Qwen3-MoE checkpoint with Qwen3-30B-A3B's layer shape
(benchmarks/acceptance/moe.py's writer; `--layers` of them, SmolLM2's vocabulary) writes every kept layer and
the unquantized embeddings and head from the source: the run's `output written` record in its timings log
(its `read`, `pack` and `write` seconds: the units read, packed, the files written and `report.json`'s
`weights_sha256` made), interleaved engine by engine,
`--repeats` times. Each engine is a repository root (this one by default; an older commit in a `git worktree`).
`--shape llama3-8b` takes a Llama-3-8B-shaped checkpoint instead (benchmarks/scale.py's writer) and
`--modifier` another step: `--modifier 'Quantize<bits:4,group_size:128,export:compressed-tensors>'` writes
every linear of every layer packed, as the 8B-shaped GPU acceptance's GPTQ does (round to nearest: the same
packing, no calibration to wait for).

    python -m benchmarks.output_write [--engines . ../before] [--layers 3] [--repeats 3] [--work DIR]
                                      [--shape qwen3-30b-a3b|llama3-8b] [--modifier STEP]
                                      [--output-dir /dev/shm] [--json FILE]

Prints a table (median and each run's seconds per engine, the output's bytes and their sha256, read after each
run: the engines must write the same bytes) and writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

from benchmarks.acceptance.moe import QWEN3_30B_A3B, output_write_s, write_moe_checkpoint
from benchmarks.scale import LLAMA3_8B, write_synthetic

ROOT = Path(__file__).resolve().parents[1]

from recipe_engine.records.fingerprints import whole_files_sha256  # noqa: E402


def write_seconds(engine: Path, recipe: Path, timings: Path) -> dict[str, float]:
    """One `recipe apply` of ``recipe`` by the engine at ``engine``; its output's write: ``seconds`` (read, pack
    and write summed) and each phase the engine's timings log splits it into."""
    env = {**os.environ, "PYTHONPATH": str(engine)}
    subprocess.run([sys.executable, "-m", "recipe_engine.cli", "apply", str(recipe), "--quiet", "--force",
                    "--no-checkpoints", "--timings", str(timings)], cwd=engine, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in timings.read_text().splitlines() if line.strip()]
    (written,) = [r for r in records if r.get("event") == "output written"]
    phases = {phase: round(written["seconds"][phase], 2) for phase in ("read", "pack", "write")
              if phase in written["seconds"]}
    return {"seconds": output_write_s(written["seconds"]), **phases}


def main() -> int:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", type=Path, default=[ROOT])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/recipe-output-write"))
    parser.add_argument("--output-dir", type=Path, default=Path("/dev/shm"),
                        help="where the outputs are written (memory: the write's own cost, not the disk's)")
    parser.add_argument("--tokenizer", default=str(ROOT / ".gpu" / "b" / "tokenizer"))
    parser.add_argument("--shape", choices=("qwen3-30b-a3b", "llama3-8b"), default="qwen3-30b-a3b")
    parser.add_argument("--modifier", default="ShortGPT<n:1>", help="the recipe's one step")
    parser.add_argument("--json", type=Path, default=Path("output_write.json"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.shape == "llama3-8b":
        import torch

        model = write_synthetic(args.work / f"llama3-8b-{args.layers}-bf16", args.layers, torch.bfloat16,
                                tokenizer=args.tokenizer, **LLAMA3_8B)
    else:
        model = write_moe_checkpoint(args.work / f"qwen3-30b-a3b-{args.layers}-bf16", args.layers, "cpu",
                                     args.tokenizer, QWEN3_30B_A3B)
    output = args.output_dir / "recipe-output-write"
    recipe = args.work / "write.yaml"
    recipe.write_text(yaml.safe_dump({
        "version": 1, "name": "output-write", "model": str(model), "dtype": "bfloat16", "device": "cpu",
        "stream": "on", "calibration": {"dataset": "wikipedia-sample", "samples": 2, "seq_len": 64, "batch_size": 2},
        "modifiers": [args.modifier], "output": str(output)}, sort_keys=False))
    rows = {str(engine): {"seconds": [], "phases": []} for engine in args.engines}
    for _ in range(args.repeats):
        for engine in args.engines:
            row = rows[str(engine)]
            phases = write_seconds(engine.resolve(), recipe, args.work / "timings.jsonl")
            row["seconds"].append(round(phases.pop("seconds"), 2))
            row["phases"].append(phases)
            row["sha256"] = whole_files_sha256(output)  # the same bytes (report.json's fingerprint differs by engine)
            row["bytes"] = sum(p.stat().st_size for p in output.glob("*.safetensors"))
            shutil.rmtree(output)
    print(f"{'engine':40s} {'median s':>9s}  read / pack / write  runs (s)              bytes          sha256")
    for engine, row in rows.items():
        row["median_s"] = statistics.median(row["seconds"])
        split = " / ".join(f"{statistics.median(p[phase] for p in row['phases']):.2f}"
                           if all(phase in p for p in row["phases"]) else "-" for phase in ("read", "pack", "write"))
        print(f"{engine:40s} {row['median_s']:9.2f}  {split:19s}  {str(row['seconds']):20s}  {row['bytes']:,}  "
              f"{row['sha256'][:12]}")
    args.json.write_text(json.dumps({"date": date.today().isoformat(), "machine": platform.platform(),
                                     "threads": os.environ.get("OMP_NUM_THREADS"), "layers": args.layers,
                                     "shape": args.shape, "modifier": args.modifier,
                                     "rows": rows}, indent=1) + "\n")
    return 0 if len({row["sha256"] for row in rows.values()}) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
