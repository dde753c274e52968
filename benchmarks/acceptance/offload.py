"""The offload leg: the small FlattenGPT recipe with the activations on the device, on the host, and streamed
from disk; identical weights."""
from __future__ import annotations

from pathlib import Path

from benchmarks.acceptance.checkpoints import identical_outputs, small_flatten_recipe
from benchmarks.acceptance.runs import LegError, apply_recipe, row


def leg_offload(args, work: Path) -> tuple[dict, list[dict]]:
    """The small FlattenGPT recipe on the tiny checkpoint (needs no SmolLM2), 8 × 64 tokens in 4 batches, with
    the activations on the device and on the host (``calibration.offload``), where each batch is loaded ahead on
    a side copy stream (``execution/activations.py`` ``CopyStream``), and streamed from disk (``stream: on``:
    each next layer read ahead by a thread, each changed layer copied back to the host on a side stream and
    staged by a thread): identical weights. On CPU the activations stay on the host (the leg only runs)."""
    recipe = small_flatten_recipe(args, work, tiny=True)
    recipe["calibration"].update(samples=8)
    walls = {}
    variants = {"offload_false": {"offload": False}, "offload_true": {"offload": True},
                "streamed": {"offload": False, "stream": "on"}}
    for name, settings in variants.items():
        variant = {**recipe, "name": name, "output": str(work / name), "stream": settings.get("stream", "off"),
                   "calibration": {**recipe["calibration"], "offload": settings["offload"]}}
        result = apply_recipe(variant, work, timeout=300 if args.tiny else 600)
        walls[name] = round(result["wall_s"], 1)
        activations_on = result["report"].activations_on
        if settings["offload"] and activations_on != "cpu":
            raise LegError(f"offload: true kept the activations on {activations_on}")
        if name == "streamed" and not result["report"].streamed:
            raise LegError("stream: on did not stream")
    identical, streamed = identical_outputs(work, ("offload_false", "offload_true", "streamed"))
    return {**walls, "identical_weights": identical, "streamed_identical_weights": streamed}, [
        row("offload", "weights with the activations on the host (prefetched) equal those kept on the device",
            identical, "", "identical", identical),
        row("offload", "weights streamed from disk (read ahead, staged through a side stream) equal them too",
            streamed, "", "identical", streamed)]
