"""FlattenGPT → GPTQ W4 on SmolLM2-135M-Instruct: perplexity, size on disk and compression time, CPU.

Rows (one run, same calibration and evaluation): dense fp32; GPTQ W4 alone; FlattenGPT (n = 6 of 30) fp32;
FlattenGPT → GPTQ W4 in the same layer-sequential pass. Calibration 32 × 512 tokens of WikiText-2
validation (seed 0); perplexity on the first 24 windows × 1024 tokens of WikiText-2 test. GPTQ: 4 bits,
groups of 64 (576 is not a multiple of 128), symmetric, act_order (static groups), sequential (the
default), packed with ``export: compressed-tensors`` (the format vLLM loads). Each row runs
``recipe_engine.apply`` and writes its checkpoint under ``--out``; "disk MiB" is the safetensors bytes
written there, "compress s" the sum of the steps' wall times. The dense row is written through
``FuseNorm`` (output-preserving) to get a checkpoint.

Run: python -m benchmarks.flatten_gptq   (prints a table, writes --out/results.json)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
from pathlib import Path

import torch

import recipe_engine
from recipe_engine.architectures.adapters import count_parameters
from recipe_engine.sources.text import load_text
from recipe_engine.sources.sizes import checkpoint_bytes
from recipe_engine.evaluation.perplexity import perplexity
from recipe_engine.sources.models import load_model

CALIBRATION = {"dataset": "wikitext2", "split": "validation", "samples": 32, "seq_len": 512, "seed": 0}
FLATTEN = ["FuseNorm", {"FlattenAdjacent": {"n": 6}}, "HeadPrune", "NystromMLP"]
GPTQ_W4 = {"GPTQ": {"bits": 4, "group_size": 64, "act_order": True, "export": "compressed-tensors"}}
ROWS = {"dense": [], "GPTQ W4": [GPTQ_W4], "FlattenGPT": FLATTEN, "FlattenGPT → GPTQ W4": FLATTEN + [GPTQ_W4]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/flatten_gptq"))
    parser.add_argument("--only", nargs="*", choices=list(ROWS))
    args = parser.parse_args()
    dense, tokenizer, _ = load_model("smollm2-135m", "float32")
    test = load_text("wikitext2", "test").text
    results = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "rows": []}
    for name, steps in ROWS.items():
        if args.only and name not in args.only:
            continue
        directory = args.out / name.replace(" ", "_").replace("→", "to")
        recipe = {"version": 1, "name": "flatten_gptq_" + directory.name, "model": "smollm2-135m",
                  "output": str(directory), "calibration": CALIBRATION, "modifiers": steps or ["FuseNorm"]}
        model, report = recipe_engine.apply(recipe, model=copy.deepcopy(dense), tokenizer=tokenizer,
                                            force=True, progress=False)
        row = {"row": name, "modifiers": steps, "layers": model.config.num_hidden_layers,
               "parameters": count_parameters(model), "disk_mib": checkpoint_bytes(directory) / 2 ** 20,
               "compress_s": sum(step.wall_s for step in report.steps) if steps else 0.0,
               "ppl": perplexity(model, tokenizer, test, seq_len=1024, limit=24)["ppl"]}
        results["rows"].append(row)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
        print(f"{name:24s} layers {row['layers']:3d}  params {row['parameters'] / 1e6:6.1f}M  "
              f"disk {row['disk_mib']:7.1f} MiB  PPL {row['ppl']:8.2f}  compress {row['compress_s']:7.1f} s",
              flush=True)
    print("\n| model | layers | parameters | safetensors MiB | WikiText-2 PPL | compress s |\n"
          "|---|---|---|---|---|---|")
    for row in results["rows"]:
        print(f"| {row['row']} | {row['layers']} | {row['parameters'] / 1e6:.1f}M | {row['disk_mib']:.1f} | "
              f"{row['ppl']:.2f} | {row['compress_s']:.0f} |")


if __name__ == "__main__":
    main()
