"""The graphs leg: GPTQ's column sweep through its CUDA graphs against the eager sweep on the device."""
from __future__ import annotations

import time
from pathlib import Path

from benchmarks.acceptance.runs import row


def leg_graphs(args, work: Path) -> tuple[dict, list[dict]]:
    """GPTQ's column sweep through its block graphs (CUDA graphs on a GPU) against the eager sweep on the
    device: identical weights, scales and zero points (static and dynamic groups), and the speed-up on a
    4096 × 4096 linear (an 8B-shaped q_proj; tiny: 24 × 96)."""
    import torch

    from recipe_engine.modifiers.gptq import gptq_quantize
    from recipe_engine.numerics.quantization import Grid

    device = torch.device(args.device)
    rows, columns, group = (24, 96, 32) if args.tiny else (4096, 4096, 128)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * columns, columns // 4, generator=generator, dtype=torch.float64) \
        @ torch.randn(columns // 4, columns, generator=generator, dtype=torch.float64)
    x += 0.3 * torch.randn(2 * columns, columns, generator=generator, dtype=torch.float64)
    weight = (0.02 * torch.randn(rows, columns, generator=generator)).to(device)
    gram = (x.T @ x).to(device)

    def timed(**options):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        result = gptq_quantize(weight, gram, Grid(4, group, False), damp=0.01, block_size=128, **options)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return result, time.perf_counter() - started

    figures, identical = {}, True
    for act_order in (True, False):
        eager, eager_s = timed(act_order=act_order, graphs=False)
        graphed, graphed_s = timed(act_order=act_order, graphs=True)
        same = all(torch.equal(a, b) for a, b in ((eager.dequantized, graphed.dequantized),
                                                    (eager.scale, graphed.scale), (eager.zero, graphed.zero)))
        identical &= same
        figures["act_order" if act_order else "dynamic_groups"] = {
            "identical": same, "eager_s": round(eager_s, 3), "graphs_s": round(graphed_s, 3),
            "speedup": round(eager_s / graphed_s, 2)}
    speedup = figures["act_order"]["speedup"]
    return figures, [row("graphs", f"GPTQ block graphs vs eager on {args.device} ({rows} x {columns})", identical, "",
                         "identical weights, scales, zeros", identical),
                     row("graphs", "GPTQ column sweep speed-up, graphs over eager (act_order, first call)", speedup,
                         "x", "recorded (no goal)", None)]
