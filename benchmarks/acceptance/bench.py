"""The GPU acceptance's bench leg, on checkpoints it builds itself (``serving.py``: Llama-3-8B-shaped, bf16, 32
layers and the 25 of FlattenGPT's 32 → 25 cut). Its served timing (``timed``) serves the w4 leg too.

  bench  `recipe bench` in its served mode (static KV cache, the decode step compiled as CUDA graphs; batch 64
         × 64-token prompts + 128 new tokens, and batch 1 after a 2048-token prefill) of the dense checkpoint
         against the 25-layer one (the layer cut alone), twice:
         tokens/s ≥ 0.95 × the weight-bytes limit (dense bytes read per token / the output's, 1.255 for
         32 → 25 with the head) at both batches, the GPU ≥ 90 % busy while decoding, the two invocations
         within 3 %.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.acceptance.runs import row, run_logged
from benchmarks.acceptance.serving import serving_checkpoints

GOAL_OF_LIMIT = 0.95        # tokens/s of the 25 layers against the weight-bytes limit
GOAL_DECODE_BUSY = 0.90     # the GPU's busy share while decoding
GOAL_REPEATABLE = 0.03      # two invocations' tokens/s apart at most
GOAL_WARMUP_S = 60          # the decode step's warm-up (compile or capture), per model and request shape


def bench_command(args, a: str, b: str, out: Path, requests: tuple[str, ...]) -> list[str]:
    """``recipe bench A B`` in the served mode (``--tiny``: seconds-sized requests), its decode step as
    ``--bench-compile`` says on a GPU (``graphs``: captured as CUDA graphs; ``on``: torch.compile), eager
    elsewhere."""
    sizes = ["--batch", "2", "--prompt-tokens", "8", "--gen-tokens", "4", "--prefill-tokens", "32",
             "--warmup", "1", "--repeats", "3"] if args.tiny else ["--repeats", str(args.bench_repeats)]
    step = args.bench_compile if args.device.startswith("cuda") else "off"
    return [sys.executable, "-m", "recipe_engine.cli", "bench", a, b, "--mode", "served", "--device", args.device,
            "--dtype", "bfloat16", "--compile", step, "--json", str(out), "--requests", *requests, *sizes]


def slowest_warmup(record: dict) -> float:
    """The longest first warm-up run (the compile or the capture, with one request) of any model and request."""
    return max(r["warmup_s"][0] for m in record["models"] for r in m["requests"].values() if r["warmup_s"])


def timed(args, work: Path, name: str, a: str, b: str, requests: tuple[str, ...]) -> dict:
    out = work / f"{name}.json"
    run_logged(bench_command(args, a, b, out, requests), work / f"{name}.log", timeout=300 if args.tiny else 580)
    return json.loads(out.read_text())


def leg_bench(args, work: Path) -> tuple[dict, list[dict]]:
    outputs = serving_checkpoints(args, work)
    records = [timed(args, work, f"bench-{i}", outputs["dense"], outputs["cut"], ("throughput", "latency"))
               for i in (1, 2)]
    first = records[0]
    limit = 1 / first["ratio_b_over_a"]["bytes_per_token"]
    goal, on_gpu = GOAL_OF_LIMIT * limit, args.device.startswith("cuda")
    rows, figures = [], {"limit": limit, "layers": outputs["layers"], "compiled": first["compiled"],
                         "decode_step": first["decode_step"], "protocol_note": first["protocol_note"],
                         "warmup_s": [{q: r["warmup_s"] for q, r in m["requests"].items()} for m in first["models"]]}
    warmup = slowest_warmup(first)
    rows.append(row("bench", f"decode step warm-up ({first['decode_step']}), the slowest model and request",
                    round(warmup, 1), "s", f"<= {GOAL_WARMUP_S}", warmup <= GOAL_WARMUP_S if on_gpu else None))
    for request in ("throughput", "latency"):
        shape = first["models"][0]["requests"][request]["shape"]
        ratio = first["ratio_b_over_a"][request]["tokens_per_s_median"]
        busy = [m["requests"][request]["gpu_busy_decode"] for m in first["models"]]
        least = min(busy) if None not in busy else None
        figures[request] = {"ratio": [r["ratio_b_over_a"][request]["tokens_per_s_median"] for r in records],
                            "tokens_per_s": [[m["requests"][request]["tokens_per_s"] for m in r["models"]]
                                             for r in records], "gpu_busy_decode": busy}
        what = f"batch {shape['batch']}, {shape['prompt_tokens']}-token prompts + {shape['gen_tokens']} new"
        rows += [row("bench", f"{request} tokens/s, 25 layers / dense ({what}), served", round(ratio, 3), "x",
                     f">= {goal:.3f} (0.95 x bytes limit {limit:.3f})", ratio >= goal if on_gpu else None),
                 row("bench", f"{request}: GPU busy while decoding (the lower of the two models)", least, "",
                     f">= {GOAL_DECODE_BUSY}", least >= GOAL_DECODE_BUSY if on_gpu and least is not None else None)]
    apart = max(abs(a["requests"][q]["tokens_per_s"]["median"] / b["requests"][q]["tokens_per_s"]["median"] - 1)
                for a, b in zip(records[0]["models"], records[1]["models"]) for q in ("throughput", "latency"))
    figures["invocations_apart"] = apart
    rows.append(row("bench", "two invocations' median tokens/s apart (worst model and request)", round(apart, 4), "",
                    f"<= {GOAL_REPEATABLE}", apart <= GOAL_REPEATABLE if on_gpu else None))
    return figures, rows
