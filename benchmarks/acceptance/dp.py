"""The dp leg: a data-parallel launch on one device (torchrun, world size 1: NCCL on a GPU, gloo on CPU) of the
small FlattenGPT recipe; its collectives ran, and its weights equal those of the same recipe in one process."""
from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.acceptance.checkpoints import identical_outputs, small_flatten_recipe
from benchmarks.acceptance.runs import apply_recipe, row


def leg_dp(args, work: Path) -> tuple[dict, list[dict]]:
    recipe = small_flatten_recipe(args, work)
    results = {}
    for mode in ("one_process", "torchrun"):
        variant = {**recipe, "name": f"dp_{mode}", "output": str(work / f"dp_{mode}")}
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] \
            if mode == "torchrun" else None
        results[mode] = apply_recipe(variant, work, timeout=300 if args.tiny else 600, launcher=launcher)
    log = results["torchrun"]["log"].read_text(errors="replace")
    nccl_lines = sum("NCCL INFO" in line for line in log.splitlines())
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    report = results["torchrun"]["report"]
    (identical,) = identical_outputs(work, ("dp_one_process", "dp_torchrun"))
    figures = {"backend": backend, "ranks": report.ranks, "wall_s": round(results["torchrun"]["wall_s"], 1),
               "one_process_wall_s": round(results["one_process"]["wall_s"], 1), "nccl_log_lines": nccl_lines,
               "identical_weights": identical}
    started = nccl_lines > 0 if backend == "nccl" else True
    return figures, [row("dp", f"torchrun world size 1 ({backend}) starts, ends, writes", 0, "exit code",
                         "0, with the backend's collectives", started),
                     row("dp", "weights equal to the one-process run", identical, "", "identical", identical)]
