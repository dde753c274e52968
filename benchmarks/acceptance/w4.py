"""The w4 leg, on the packed W4 g128 25-layer checkpoint it builds itself (``serving.py``): its checkpoint
bytes ≤ 0.31 × the dense bf16 checkpoint's, and its batch-1 decode tokens/s (PyTorch's int4 kernel) ≥ 2.0 × dense
(``recipe bench`` in its served mode)."""
from __future__ import annotations

from pathlib import Path

from benchmarks.acceptance.bench import timed
from benchmarks.acceptance.runs import row
from benchmarks.acceptance.serving import serving_checkpoints

GOAL_W4_BYTES = 0.31        # packed checkpoint / dense bf16 checkpoint
GOAL_W4_DECODE = 2.0        # batch-1 decode tokens/s, packed / dense


def leg_w4(args, work: Path) -> tuple[dict, list[dict]]:
    from recipe_engine.sources.sizes import checkpoint_bytes

    outputs = serving_checkpoints(args, work)
    dense, packed = outputs["dense"], outputs["packed"]
    size = checkpoint_bytes(packed) / checkpoint_bytes(dense)
    record = timed(args, work, "w4", dense, packed, ("latency",))
    ratio = record["ratio_b_over_a"]["latency"]["decode_tokens_per_s_median"]
    limit = 1 / record["ratio_b_over_a"]["bytes_per_token"]
    on_gpu = args.device.startswith("cuda")
    figures = {"checkpoint_bytes": [checkpoint_bytes(dense), checkpoint_bytes(packed)], "bytes_ratio": size,
               "decode_ratio": ratio, "limit": limit, "weights": [m["weights"] for m in record["models"]],
               "decode_tokens_per_s": [m["requests"]["latency"]["decode_tokens_per_s"] for m in record["models"]]}
    return figures, [
        row("w4", "packed W4 g128 checkpoint bytes / dense bf16", round(size, 4), "x", f"<= {GOAL_W4_BYTES}",
            size <= GOAL_W4_BYTES if not args.tiny else None),
        row("w4", f"batch-1 decode tokens/s, packed W4 (int4 kernel) / dense (bytes limit {limit:.2f})",
            round(ratio, 3), "x", f">= {GOAL_W4_DECODE}", ratio >= GOAL_W4_DECODE if on_gpu else None)]
