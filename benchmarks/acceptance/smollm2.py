"""The smollm2 leg: SmolLM2-135M, the default FlattenGPT recipe and ``GPTQ<bits:4,group_size:64>`` on the device;
the merged layers equal, and the WikiText-2 PPLs lie within 1 % of, the committed CPU run (``reference.json``)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks.acceptance.checkpoints import ROOT, load_yaml, tiny_checkpoint
from benchmarks.acceptance.runs import LegError, apply_recipe, row

REFERENCE = Path(__file__).resolve().parent / "reference.json"
GOAL_PPL_RELATIVE = 0.01


def merges(report) -> list[list[int]]:
    """Original layers behind each merged (wider than one) layer of the output."""
    return [list(o) for o in report.after.layer_origin if len(o) > 1]


def ppl(report, when: str) -> float:
    return float(getattr(report.evaluation, when).perplexity.ppl)


def relative_row(leg: str, figure: str, value: float, reference: float) -> dict:
    off = abs(value / reference - 1)
    return row(leg, figure, round(value, 4), "PPL", f"within {GOAL_PPL_RELATIVE:.0%} of CPU {reference:.4f}",
               off <= GOAL_PPL_RELATIVE, relative_difference=round(off, 6))


def smollm2_recipes(device: str, work: Path, tiny: bool) -> dict[str, dict]:
    """The two recipes of the leg, as run (``tiny``: the same steps on a tiny random model, small data)."""
    flatten = load_yaml(ROOT / "recipes" / "flatten20_smollm2.yaml")
    gptq = load_yaml(ROOT / "recipes" / "gptq4_smollm2.yaml")
    gptq["modifiers"][0]["GPTQ"]["export"] = "dequantized"  # compressed-tensors is not on the GPU image
    gptq["evaluate"]["perplexity"]["limit"] = 24            # BENCHMARKS.md's GPTQ protocol (24 × 1024)
    if tiny:
        model = str(tiny_checkpoint(work))
        for recipe in (flatten, gptq):
            recipe["model"] = model
            recipe["calibration"].update(samples=4, seq_len=64, batch_size=2)
            recipe["evaluate"]["perplexity"].update(seq_len=64, limit=2)
        flatten["modifiers"][1]["FlattenAdjacent"]["n"] = 2
        gptq["modifiers"][0]["GPTQ"]["group_size"] = 32
    for recipe in (flatten, gptq):
        recipe["device"] = device
        recipe["name"] = f"{recipe['name']}_{device.replace(':', '')}"
        recipe["output"] = str(work / recipe["name"])
    return {"flatten": flatten, "gptq": gptq}


def smollm2_figures(device: str, work: Path, tiny: bool) -> dict:
    """Merged layers and PPLs of the two recipes on ``device``."""
    figures = {}
    for key, recipe in smollm2_recipes(device, work, tiny).items():
        result = apply_recipe(recipe, work, timeout=600 if tiny else 1200)
        report = result["report"]
        figures[key] = {"merges": merges(report), "ppl_dense": ppl(report, "before"),
                        "ppl_after": ppl(report, "after"), "layers": report.after.layers,
                        "wall_s": round(result["wall_s"], 1), "device": report.device}
        shutil.rmtree(recipe["output"], ignore_errors=True)
    return figures


def leg_smollm2(args, work: Path) -> tuple[dict, list[dict]]:
    figures = smollm2_figures(args.device, work, args.tiny)
    if args.tiny:
        reference = {"figures": smollm2_figures("cpu", work / "cpu-reference", True)} \
            if args.device != "cpu" else {"figures": figures}
        source = "CPU run of the same tiny recipes"
    else:
        if not REFERENCE.is_file():
            raise LegError(f"{REFERENCE.relative_to(ROOT)} is missing (make it: --device cpu --legs smollm2 "
                           f"--write-reference)")
        reference = json.loads(REFERENCE.read_text())
        source = str(REFERENCE.relative_to(ROOT))
    ref = reference["figures"]
    rows = [row("smollm2", "FlattenGPT merged layers", figures["flatten"]["merges"], "original layers",
                f"equal to CPU {ref['flatten']['merges']}", figures["flatten"]["merges"] == ref["flatten"]["merges"]),
            relative_row("smollm2", "dense WikiText-2 PPL", figures["flatten"]["ppl_dense"],
                         ref["flatten"]["ppl_dense"]),
            relative_row("smollm2", "FlattenGPT WikiText-2 PPL", figures["flatten"]["ppl_after"],
                         ref["flatten"]["ppl_after"]),
            relative_row("smollm2", "GPTQ W4 g64 WikiText-2 PPL", figures["gptq"]["ppl_after"],
                         ref["gptq"]["ppl_after"])]
    return {"figures": figures, "reference": source}, rows
