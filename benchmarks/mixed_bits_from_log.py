"""More bits where a W4 run lost most: GPTQ overrides chosen from its quantization log, under a bits budget.

    python -m benchmarks.mixed_bits_from_log OUT/quantization_log.csv --budget 4.5 [--bits 8] > overrides.yaml

The log of a uniform GPTQ run (``quantization_log.csv``: every linear's ``error``, the relative output error
``‖(W − Q) X‖² / ‖W X‖²`` on the calibration inputs) ranks the linears. The units an override can name are those
GPTQ quantizes as one matrix (a layer's q/k/v, its gate/up; o_proj and down_proj alone); a unit's error is the
largest of its linears'. Greedy: units by error, largest first, each promoted to ``--bits`` while the average
stored bits per weight of every logged linear stays within ``--budget``, counted as the compressed-tensors
export writes them (``Exporter.stored_bits``: codes, scales in the model dtype, ``weight_shape``). Prints the
``overrides:`` list (one entry per promoted unit kind, with its layers) and, on stderr, the average reached.
"""
from __future__ import annotations

import argparse
import csv
import sys

import torch
import yaml

from recipe_engine.formats import checkpoint_exporter
from recipe_engine.numerics.quantization import Grid

UNITS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up",
         "o_proj": "o_proj", "down_proj": "down_proj"}
TARGETS = {"qkv": ["q_proj", "k_proj", "v_proj"], "gate_up": ["gate_proj", "up_proj"], "o_proj": ["o_proj"],
           "down_proj": ["down_proj"]}


def stored_bits(row: dict, bits: int, dtype: torch.dtype) -> int:
    exporter = checkpoint_exporter("compressed-tensors")
    grid = Grid(bits, int(row["group_size"]), row["sym"] == "True", exporter.scale_dtype(dtype))
    return exporter.stored_bits((int(row["rows"]), int(row["columns"])), grid, dtype)


def choose(rows: list[dict], budget: float, bits: int, dtype: torch.dtype) -> tuple[list[dict], float]:
    """The promoted units as GPTQ overrides and the average bits per weight they reach."""
    weights = sum(int(r["rows"]) * int(r["columns"]) for r in rows)
    total = sum(stored_bits(r, int(r["bits"]), dtype) for r in rows)
    units: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        units.setdefault((int(row["layer"]), UNITS[row["module"].rpartition(".")[2]]), []).append(row)
    ranked = sorted(units.items(), key=lambda item: -max(float(r["error"]) for r in item[1]))
    promoted: dict[str, list[int]] = {}
    for (layer, unit), members in ranked:
        extra = sum(stored_bits(r, bits, dtype) - stored_bits(r, int(r["bits"]), dtype) for r in members)
        if (total + extra) / weights <= budget:
            total += extra
            promoted.setdefault(unit, []).append(layer)
    overrides = [{"layers": sorted(layers), "targets": TARGETS[unit], "bits": bits}
                 for unit, layers in promoted.items()]
    return overrides, total / weights


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="quantization_log.csv of a uniform GPTQ run")
    parser.add_argument("--budget", type=float, default=4.5, help="average stored bits per weight at most")
    parser.add_argument("--bits", type=int, default=8, help="the promoted units' bits")
    parser.add_argument("--dtype", default="float32", help="the model dtype the checkpoint stores scales in")
    args = parser.parse_args(argv)
    with open(args.log, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["method"] != "rtn-fallback"]
    overrides, reached = choose(rows, args.budget, args.bits, getattr(torch, args.dtype))
    print(yaml.safe_dump({"overrides": overrides}, default_flow_style=None, sort_keys=False), end="")
    print(f"{sum(len(o['layers']) for o in overrides)} units at {args.bits} bits: {reached:.4f} bits per weight "
          f"(budget {args.budget})", file=sys.stderr)


if __name__ == "__main__":
    main()
