"""The stream8b leg: a Llama-3-8B-shaped bf16 checkpoint streamed through FlattenGPT and packed GPTQ W4 g128;
per-step times against their goals (extrapolated to 32 layers), the GPU's utilisation, peak GPU and host
memory against the plan's estimates."""
from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.acceptance.checkpoints import TINY_LAYERS, TINY_SHAPE
from benchmarks.acceptance.runs import GOAL_GPU_BUSY, GOAL_GPU_OVER_ESTIMATE, LegError, apply_recipe, row

LLAMA3_8B_LAYERS = 32
#: The goals (one H100, 8B-shaped bf16, 32 layers at 128 × 2048): FlattenGPT steps within 3 minutes (the paper:
#: 7 on one H800), GPTQ within 2 (llm-compressor: 12).
GOAL_FLATTEN_S = 3 * 60
GOAL_GPTQ_S = 2 * 60


def stream8b_merges(layers: int) -> int:
    """FlattenGPT's merges on ``layers`` of Llama-3-8B's 32: the recipe's 7 scaled (8 layers: 2)."""
    return max(1, round(7 * layers / LLAMA3_8B_LAYERS))


def stream8b_recipe(args, model: Path, work: Path) -> dict:
    layers = getattr(args, "layers", LLAMA3_8B_LAYERS)
    packed = {"bits": 4, "group_size": 128, "export": "compressed-tensors"}  # what vLLM and SGLang load
    steps = [f"FlattenAdjacent<n:{stream8b_merges(layers)}>", "HeadPrune", "NystromMLP", {"GPTQ": packed}]
    samples, seq_len, batch = args.samples, args.seq_len, 4
    if args.tiny:
        steps = ["FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP", {"GPTQ": {**packed, "group_size": 32}}]
        samples, seq_len, batch = 4, 64, 2
    return {"version": 1, "name": "stream8b", "model": str(model), "dtype": "bfloat16", "device": args.device,
            "stream": "on", "calibration": {"dataset": "wikipedia-sample", "split": "train", "samples": samples,
                                            "seq_len": seq_len, "batch_size": batch, "seed": 0},
            "modifiers": steps, "output": str(work / "stream8b-out")}


def device_estimate(recipe: dict, config, activations_on_device: bool = False) -> dict:
    """The accelerator's share of ``recipe plan``'s estimate (``recipe_engine.plan.estimates.estimate``, streamed):
    the largest step's weights (a layer-scope step: its largest layer and one original layer) and the part
    of its working memory that does not grow with the calibration tokens (statistics, solve buffers), plus
    one batch's activations (the MLP intermediate ×3 in fp32, the host estimate's one-batch term). With the
    activations on the host (``calibration.offload``) what grows with the tokens (e.g. GPTQ's recorded block
    inputs) lives there; the token-independent part is the intercept of each step's working memory between
    ``samples`` and ``2 × samples`` windows (affine in the tokens). ``activations_on_device`` (the run kept
    them there, ``report.activations_on``): the whole working memory and the plan's activations count."""
    from recipe_engine.plan.estimates import estimate
    from recipe_engine.recipe.schema import recipe_from_dict

    cal = recipe["calibration"]

    def steps(samples: int) -> list[dict]:
        scaled = recipe_from_dict({**recipe, "calibration": {**cal, "samples": samples}})
        return estimate(scaled, config, streamed=True, runtime=0).to_dict()["steps"]

    if activations_on_device:  # the engine's own device estimate (``recipe plan`` prints it)
        plan = estimate(recipe_from_dict(recipe), config, streamed=True, runtime=0, on_device=True).to_dict()
        on_device = [{"step": a["step"], "bytes": a["weights_bytes"] + a["working_bytes"]} for a in plan["steps"]]
        largest = max(on_device, key=lambda s: s["bytes"])
        return {"bytes": plan["device_peak_bytes"], "largest_step": largest["step"],
                "batch_activations_bytes": plan["activations_bytes"],
                "steps_bytes": {s["step"]: s["bytes"] for s in on_device}}
    on_device = [{"step": a["step"], "bytes": a["weights_bytes"] + max(0, 2 * a["working_bytes"] - b["working_bytes"])}
                 for a, b in zip(steps(cal["samples"]), steps(2 * cal["samples"]))]
    largest = max(on_device, key=lambda s: s["bytes"])
    batch = 3 * cal["batch_size"] * cal["seq_len"] * config.intermediate_size * 4
    return {"bytes": largest["bytes"] + batch, "largest_step": largest["step"], "batch_activations_bytes": batch,
            "steps_bytes": {s["step"]: s["bytes"] for s in on_device}}


def leg_stream8b(args, work: Path) -> tuple[dict, list[dict]]:
    import torch

    from benchmarks import scale
    from recipe_engine.sources.models import load_config

    started = time.perf_counter()
    shape, layers = (TINY_SHAPE, TINY_LAYERS) if args.tiny else (scale.LLAMA3_8B, args.layers)
    model = scale.write_synthetic(work / ("tiny-llama-bf16" if args.tiny else f"llama3-8b-{layers}-bf16"), layers,
                                  torch.bfloat16, device=args.device, tokenizer=args.tokenizer, **shape)
    written_s = time.perf_counter() - started
    recipe = stream8b_recipe(args, model, work)
    try:
        result = apply_recipe(recipe, work, timeout=600 if args.tiny else 1500, trace=True)
    except LegError as error:  # per-step times of the layers it finished, and their extrapolation
        partial = getattr(error, "partial", {})
        raise LegError(f"{error} [finished: {json.dumps(partial.get('layers_done', {}))}; seconds by step: "
                       f"{json.dumps(partial.get('seconds_by_step', {}))}]") from None
    report = result["report"]
    estimate = device_estimate(recipe, load_config(str(model)), report.activations_on not in (None, "cpu"))
    steps = {f"{s.index} {s.modifier}": round(s.wall_s, 2) for s in report.steps}
    shared = max((s.pass_shared_s for s in report.steps if s.shared_pass), default=0.0)
    # the shared pass's own time (loading, shared forwards) goes with FlattenGPT's steps, which share it
    flatten_s = sum(s.wall_s for s in report.steps if s.modifier != "GPTQ") + shared
    gptq_s = sum(s.wall_s for s in report.steps if s.modifier == "GPTQ")
    scale_up = LLAMA3_8B_LAYERS / layers if not args.tiny else 1.0  # ``--layers``: per-layer figures × 32 / L
    gpu_mib = report.peak_memory.cuda_mib
    host_gib = (result["watched_peak_mib"] or report.peak_memory.rss_mib) / 1024
    figures = {"checkpoint_gib": round(sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**30, 3),
               "checkpoint_written_s": round(written_s, 1), "apply_wall_s": round(result["wall_s"], 1),
               "steps_own_s": steps, "pass_shared_s": round(shared, 2),
               "layers": f"{report.before.layers} -> {report.after.layers}",
               "calibration": f"{recipe['calibration']['samples']} x {recipe['calibration']['seq_len']}",
               "peak_gpu_mib": gpu_mib, "gpu_estimate_mib": round(estimate["bytes"] / 2**20, 1),
               "gpu_estimate_largest_step": estimate["largest_step"],
               "gpu_estimate_steps_mib": {k: round(v / 2**20, 1) for k, v in estimate["steps_bytes"].items()},
               "peak_host_gib": round(host_gib, 3),
               "host_estimate_gib": round(report.peak_memory.estimate_rss_mib / 2**10, 3),
               "timings": result["timings"], "gpu_busy": result["gpu_busy"],
               "model_layers": layers, "extrapolated_to_32_layers_x": scale_up}
    on_gpu = report.device.startswith("cuda")
    figures["steps"] = recipe["modifiers"]
    label = "" if scale_up == 1 else f", {layers} layers x {scale_up:g} (extrapolated to 32)"
    flatten_32, gptq_32 = flatten_s * scale_up, gptq_s * scale_up
    busy = result["gpu_busy"]
    rows = [row("stream8b", f"FlattenGPT steps (FlattenAdjacent, HeadPrune, NystromMLP; + shared pass){label}",
                round(flatten_32, 1), "s", f"<= {GOAL_FLATTEN_S} (one H100)",
                flatten_32 <= GOAL_FLATTEN_S if on_gpu else None, measured_s=round(flatten_s, 1)),
            row("stream8b", f"GPTQ W4 g128, whole model (own time in the shared pass){label}", round(gptq_32, 1), "s",
                f"<= {GOAL_GPTQ_S} (one H100)", gptq_32 <= GOAL_GPTQ_S if on_gpu else None,
                measured_s=round(gptq_s, 1)),
            row("stream8b", "GPU busy (nvidia-smi utilisation, mean over the apply run)", busy, "",
                f">= {GOAL_GPU_BUSY}", busy >= GOAL_GPU_BUSY if on_gpu and busy is not None else None),
            row("stream8b", "peak GPU memory / plan's one-layer estimate",
                round(gpu_mib * 2**20 / estimate["bytes"], 3) if gpu_mib else None, "x",
                f"<= {GOAL_GPU_OVER_ESTIMATE}", gpu_mib * 2**20 <= GOAL_GPU_OVER_ESTIMATE * estimate["bytes"]
                if gpu_mib else None),
            row("stream8b", "peak host memory / the run's host estimate (recipe plan's, activations where they went)",
                round(host_gib * 2**10 / report.peak_memory.estimate_rss_mib, 3), "x", "recorded (no goal)", None)]
    return figures, rows
