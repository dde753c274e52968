"""GPTQ of many experts' ``down_proj``, each with its own Hessian: one call per expert against batched calls
(``gptq_quantize_batch``) of several experts, on CPU or a GPU; the batched results are checked against the
one-at-a-time ones (bit for bit on CPU).

    OMP_NUM_THREADS=1 python -m benchmarks.expert_batch --experts 8 --batches 1 2 4 8
    python -m benchmarks.expert_batch --device cuda --experts 128 --batches 1 8 16 32

Shape: Qwen3-30B-A3B's expert ``down_proj`` (2048 × 768, bf16; random weights, std 0.02), Hessians ``XᵀX`` of
1024 random tokens each; the grid of the MoE benchmark (4 bits, groups of 128, symmetric, act_order). Each
batch size is timed twice, interleaved, and the faster time kept (the machine is shared).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from recipe_engine.modifiers.gptq import gptq_quantize_batch
from recipe_engine.numerics.quantization import Grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--columns", type=int, default=768)
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    weights = (0.02 * torch.randn(args.experts, args.rows, args.columns, generator=generator)).bfloat16().to(device)
    x = torch.randn(args.experts, 1024, args.columns, generator=generator).to(device)
    grams = (x.transpose(1, 2) @ x).double()
    grid = Grid(4, 128, True, torch.bfloat16)

    def solve(size: int) -> torch.Tensor:
        results = [gptq_quantize_batch(weights[k:k + size], grams[k:k + size], grid, True, 0.01, 128).dequantized
                   for k in range(0, args.experts, size)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return torch.cat(results)

    reference = solve(1)
    seconds = {size: float("inf") for size in args.batches}
    for _ in range(2):
        for size in args.batches:
            started = time.perf_counter()
            result = solve(size)
            seconds[size] = min(seconds[size], time.perf_counter() - started)
            if not torch.equal(result, reference):
                difference = float((result - reference).abs().max())
                print(f"batch {size}: differs from one at a time by at most {difference:.3g}")
    print(json.dumps({"device": str(device), "experts": args.experts, "shape": [args.rows, args.columns],
                      "seconds_by_batch": {size: round(s, 3) for size, s in seconds.items()},
                      "threads": torch.get_num_threads()}, indent=1))


if __name__ == "__main__":
    main()
