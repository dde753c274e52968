"""GPTQ's two speed-ups side by side (the Llama-3-8B GPTQ leg is CPU-bound), fp64, same inputs.

1. The inverse-Hessian factor: ``inverse_hessian_factor`` (reversed Cholesky + triangular inverse, n³/3
   multiply-adds) against the GPTQ reference code's chain (Cholesky, ``cholesky_inverse``, upper Cholesky:
   2n³/3), at ``--size``.
2. The column sweep: ``gptq_quantize`` with ``SUB_BLOCK = 16`` (rank-1 updates within 16 columns, one
   product per sub-block) against ``SUB_BLOCK = 1`` (every column updates the rest of its 128-column
   block: the reference code's loop), on a ``gate_proj``-shaped weight (``--rows`` × ``--columns``), with and
   without act_order; the grid points must agree.

  python -m benchmarks.gptq_speed [--size 8192] [--rows 14336 --columns 2048] [--threads 2] [--repeat 2]

Each pair runs alternately ``--repeat`` times and the fastest of each is kept (the CPU is shared).

Writes benchmarks/results/raw/gptq_speed.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from functools import partial
from pathlib import Path

import torch

from recipe_engine.modifiers import gptq
from recipe_engine.modifiers._quant import Grid

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "raw"   # raw output (ignored by git)


def reference_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """The GPTQ reference code's chain: chol(H + λI), its inverse, the inverse's upper Cholesky factor."""
    damped = hessian.clone()
    damped.diagonal().add_(damp * torch.diagonal(hessian).mean())
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(damped))
    return torch.linalg.cholesky(inverse, upper=True)


def timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def fastest(first, second, repeat: int):
    """``(result, best seconds)`` of two functions run alternately ``repeat`` times (a shared, noisy CPU)."""
    best = [None, None]
    for _ in range(repeat):
        for k, function in enumerate((first, second)):
            result, seconds = timed(function)
            best[k] = (result, min(seconds, best[k][1]) if best[k] else seconds)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=14336)
    parser.add_argument("--columns", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="alternate runs; the fastest of each counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    rows = []

    x = torch.randn(args.size + 64, args.size, generator=generator, dtype=torch.float64)
    hessian = x.T @ x
    del x
    # the Hessian is bound here, not read at call time from the name the ``del`` below removes
    (expected, reference_s), (got, ours_s) = fastest(partial(reference_factor, hessian, 0.01),
                                                     partial(gptq.inverse_hessian_factor, hessian, 0.01), args.repeat)
    rows.append({"what": f"inverse-Hessian factor, n = {args.size}", "reference_s": reference_s, "ours_s": ours_s,
                 "ratio": ours_s / reference_s,
                 "max_relative_difference": float((got - expected).abs().max() / expected.abs().max())})
    del hessian, expected, got

    x = torch.randn(4096, args.columns, generator=generator)
    gram = (x.T @ x).double()
    weight = torch.randn(args.rows, args.columns, generator=generator) * 0.02
    grid = Grid(bits=4, group_size=128, sym=False)
    for act_order in (True, False):
        def sweep(sub: int, act_order: bool = act_order):
            saved, gptq.SUB_BLOCK = gptq.SUB_BLOCK, sub
            try:
                return gptq.gptq_quantize(weight, gram, grid, act_order, 0.01, 128)
            finally:
                gptq.SUB_BLOCK = saved

        (one, one_s), (ours, ours_s) = fastest(lambda: sweep(1), lambda: sweep(gptq.SUB_BLOCK), args.repeat)
        step = one.scale.repeat_interleave(128, 1)
        rows.append({"what": f"column sweep {args.rows} x {args.columns}, g128, act_order={act_order}",
                     "reference_s": one_s, "ours_s": ours_s, "ratio": ours_s / one_s,
                     "max_grid_step_difference": float(((one.dequantized - ours.dequantized).abs() / step).max())})

    meta = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "repeat": args.repeat,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average": os.getloadavg()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gptq_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print("| what | reference s | ours s | ours / reference | difference |")
    print("|---|---|---|---|---|")
    for row in rows:
        difference = row.get("max_relative_difference", row.get("max_grid_step_difference"))
        print(f"| {row['what']} | {row['reference_s']:.1f} | {row['ours_s']:.1f} | {row['ratio']:.2f} | "
              f"{difference:.1e} |")
    print(f"load average {meta['load_average']}")


if __name__ == "__main__":
    main()
