"""FlattenGPT ablation on SmolLM2-135M-Instruct (30 layers, n = 6 merges), CPU.

Protocol: calibration 32 × 512 tokens of WikiText-2 validation (seed 0); perplexity on the first 24
windows × 1024 tokens of WikiText-2 test. FlattenAdjacent runs once; every pruning variant starts from a
copy of the flattened model, so its wall time is the flatten time plus its own pruning pass. The reference
row drops the 6 layers with the lowest Block Influence (ShortGPT: BI = 1 − mean cos(input, output)).

Run: python -m benchmarks.flatten_ablation [--only NAME ...]   (merges its rows into
benchmarks/results/raw/flatten_ablation.json, each row dated;
``--table``  prints the Markdown table of that file)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from recipe_engine.architectures.adapters import adapter_for, count_parameters
from recipe_engine.sources.text import load_text
from recipe_engine.sources.windows import sample_windows, tokenize
from recipe_engine.evaluation.perplexity import perplexity
from recipe_engine.sources.models import load_model
from recipe_engine.execution.steps import run_steps
from recipe_engine.recipe.schema import CalibrationConfig, parse_step
from recipe_engine.execution.context import RunContext
from recipe_engine.execution.session import Session
from recipe_engine.system.progress import Progress

MERGES = 6
PAPER_MLP = "NystromMLP<lambda_scale:10,target:merged>"
PAPER_HEADS = "HeadPrune<criterion:eq12,compensate:false>"
#: name → (description, pruning steps after FlattenAdjacent, calibration.propagate)
VARIANTS = {
    "default": ("defaults: groups by exhaustive compensated o_proj error + o_proj refit + Nyström + down_proj "
                "refit towards the original model's hidden state (λ = 0.1 × mean eig.), sequential",
                ["HeadPrune", "NystromMLP"], "compressed"),
    "default_no_target": ("defaults with the paper's Theorem 3.1 refit only (target: merged)",
                          ["HeadPrune", "NystromMLP<target:merged>"], "compressed"),
    "paper": ("paper: Eq. 12 heads + Nyström MLP, one-shot statistics", [PAPER_HEADS, PAPER_MLP], "original"),
    "flatten_only": ("flatten, not pruned (wider layers)", [], "compressed"),
    "eq12_compensated": ("Eq. 12 heads + o_proj ridge refit + Nyström",
                         ["HeadPrune<criterion:eq12>", PAPER_MLP], "compressed"),
    "greedy_reconstruction": ("groups by compensated o_proj error, greedy + refit + Nyström",
                              ["HeadPrune<exhaustive_limit:1>", PAPER_MLP], "compressed"),
    "default_one_shot": ("defaults, one-shot statistics (propagate: original)", ["HeadPrune", "NystromMLP"],
                         "original"),
    "heads_lambda_0.1": ("defaults with HeadPrune λ = 0.1 × mean eig.", ["HeadPrune<lambda_scale:0.1>", "NystromMLP"],
                         "compressed"),
    "heads_lambda_1": ("defaults with HeadPrune λ = 1 × mean eig.", ["HeadPrune<lambda_scale:1>", "NystromMLP"],
                       "compressed"),
    "mlp_refit_lambda_0.1": ("defaults with NystromMLP refit λ = 0.1 × mean eig.",
                             ["HeadPrune", "NystromMLP<compensation_scale:0.1,target:merged>"], "compressed"),
    "mlp_target_1": ("defaults with target λ = 1 × mean eig.", ["HeadPrune", "NystromMLP<target_scale:1>"],
                     "compressed"),
    "mlp_target_serial": ("defaults with target: serial (the original layers run serially on the merged layer's "
                          "input)", ["HeadPrune", "NystromMLP<target:serial>"], "compressed"),
    "mlp_target_serial_1": ("defaults with target: serial, λ = 1 × mean eig.",
                            ["HeadPrune", "NystromMLP<target:serial,target_scale:1>"], "compressed"),
    "flatten_nystrom": ("flatten + NystromMLP (λ = 10 × mean eig.), heads not pruned", [PAPER_MLP], "compressed"),
    "flatten_eq12": ("flatten + HeadPrune (Eq. 12), MLP not pruned", [PAPER_HEADS], "compressed"),
    "paper_sequential": ("paper, sequential statistics", [PAPER_HEADS, PAPER_MLP], "compressed"),
}


def calibration_session(model, tokenizer, windows, propagate: str, original=None) -> Session:
    config = CalibrationConfig(dataset="wikitext2", split="validation", samples=windows.shape[0],
                               seq_len=windows.shape[1], batch_size=4, propagate=propagate)
    return Session(RunContext(tokenizer, adapter_for(model.config), config, torch.device("cpu")), model, windows,
                   reference_loader=(lambda: original) if original is not None else None)


@torch.no_grad()
def plain_forward_seconds(model, windows) -> float:
    start = time.perf_counter()
    for batch in windows.split(4):
        model(input_ids=batch, use_cache=False)
    return time.perf_counter() - start


@torch.no_grad()
def drop_lowest_block_influence(session: Session, count: int) -> list[int]:
    """ShortGPT reference: remove the ``count`` layers with the lowest BI = 1 − mean_t cos(x_t, y_t)."""
    influence: dict[int, float] = {}

    def record(index, inputs, outputs):
        cos = [torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1) for x, y in zip(inputs, outputs)]
        influence[index] = 1.0 - float(torch.cat([c.flatten() for c in cos]).double().mean())

    session.view.layer_pass(record, "block influence")
    dropped = sorted(sorted(influence, key=influence.get)[:count])
    kept = [i for i in range(len(session.layers)) if i not in dropped]
    session.view.set_layers([session.layers[i] for i in kept], [(i,) for i in kept], kept)
    return dropped


def run_steps_timed(session: Session, steps: list[str]) -> tuple[list[dict], float]:
    start = time.perf_counter()
    records = run_steps(session, [parse_step(s, i) for i, s in enumerate(steps)], Progress(enabled=False))
    return records, time.perf_counter() - start


def reference_row(name: str, model, tokenizer, windows):
    """(description, model, seconds, detail) of the dense model or the ShortGPT layer-dropping reference."""
    if name == "dense":
        return "original model", model, 0.0, None
    dropped_model = copy.deepcopy(model)
    start = time.perf_counter()
    dropped = drop_lowest_block_influence(calibration_session(dropped_model, tokenizer, windows, "original"), MERGES)
    return (f"ShortGPT: drop the {MERGES} lowest-BI layers {dropped}", dropped_model, time.perf_counter() - start,
            {"dropped": dropped})


def markdown_table(result: dict) -> str:
    """The ablation as a Markdown table (PPL, layers, parameters, wall time vs one calibration forward)."""
    lines = ["| row | PPL | layers | params | compression time | × forward | what |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['name']} | {row['ppl']:.2f} | {row['layers']} | {row['parameters'] / 1e6:.1f}M | "
                     f"{row['compress_s']:.0f} s | {row['compress_over_forward']:.1f} | {row['description']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="rows to run (default: all, incl. dense and shortgpt)")
    parser.add_argument("--out", default="benchmarks/results/raw/flatten_ablation.json")
    parser.add_argument("--table", action="store_true", help="print the table of an existing --out file and exit")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(json.loads(Path(args.out).read_text())))
        return
    torch.manual_seed(0)
    model, tokenizer, _ = load_model("smollm2-135m", "float32")
    valid = load_text("wikitext2", "validation")
    windows = sample_windows(tokenize(tokenizer, valid.text), 32, 512, 0, valid.origin)
    test = load_text("wikitext2", "test").text
    forward_s = plain_forward_seconds(model, windows)
    machine = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout
    earlier = json.loads(Path(args.out).read_text())["rows"] if Path(args.out).exists() else []
    by_name = {row["name"]: row for row in earlier}  # rows of earlier runs stay unless re-run
    result = {"date": datetime.date.today().isoformat(), "machine": machine.split(":", 1)[-1].strip(),
              "threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
              "protocol": {"calibration": "wikitext2 validation 32x512 seed 0", "eval": "wikitext2 test 24x1024",
                           "merges": MERGES}, "plain_forward_s": forward_s, "rows": []}
    flat_session = calibration_session(copy.deepcopy(model), tokenizer, windows, "compressed")
    flat_records, flatten_s = run_steps_timed(flat_session, [f"FlattenAdjacent<n:{MERGES}>"])
    groups = [{k: g[k] for k in ("origin", "similarity")} for g in flat_records[0]["result"]["groups"]]
    result["flatten"] = {"seconds": flatten_s, "groups": groups}
    print(f"plain calibration forward {forward_s:.1f}s; flatten {flatten_s:.1f}s, groups {groups}", flush=True)
    order = ["default", "paper", "shortgpt", "dense"] + [n for n in VARIANTS if n not in ("default", "paper")]
    for name in order:
        if args.only and name not in args.only:
            continue
        if name in VARIANTS:
            description, steps, propagate = VARIANTS[name]
            session = calibration_session(copy.deepcopy(flat_session.model), tokenizer, windows, propagate, model)
            session.layer_origin = list(flat_session.layer_origin)
            records, prune_s = run_steps_timed(session, steps) if steps else ([], 0.0)
            compressed, seconds = session.model, flatten_s + prune_s
            detail = {"steps": steps, "propagate": propagate,
                      "results": [{"modifier": r["modifier"], "result": r["result"]} for r in records]}
        else:
            description, compressed, seconds, detail = reference_row(name, model, tokenizer, windows)
        row = {"name": name, "description": description,
               "ppl": perplexity(compressed, tokenizer, test, seq_len=1024, limit=24)["ppl"],
               "layers": compressed.config.num_hidden_layers, "parameters": count_parameters(compressed),
               "compress_s": seconds, "compress_over_forward": seconds / forward_s, "detail": detail}
        row["date"] = result["date"]
        by_name[name] = row
        result["rows"] = sorted(by_name.values(), key=lambda r: order.index(r["name"]) if r["name"] in order
                                else len(order))
        print(f"{name:22s} ppl {row['ppl']:8.2f}  layers {row['layers']}  params {row['parameters'] / 1e6:.1f}M  "
              f"time {seconds:6.1f}s ({row['compress_over_forward']:.1f}× forward)  {description}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(markdown_table(result))


if __name__ == "__main__":
    main()
