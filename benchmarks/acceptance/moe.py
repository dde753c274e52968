"""The GPU acceptance's mixture-of-experts leg (``python -m benchmarks.acceptance --legs moe``).

  moe   a Qwen3-30B-A3B-shaped bf16 synthetic checkpoint (hidden 2048, 128 experts of width 768, top-8, 32 / 4
        heads of 128; ``--moe-layers`` of its 48 layers, all 128 experts each), streamed through
        ``GPTQ<bits:4,group_size:128>`` (the packed default: compressed-tensors) on every expert (``experts: all``)
        at ``--samples`` × ``--seq-len`` Wikipedia-sample tokens. Goals: the GPTQ time per layer (its step plus
        the shared pass) × 48 ≤ 10 minutes on one GPU, the GPU ≥ 60 % busy (during the layer-sequential pass, and
        over the whole run extrapolated to 48 layers; the 8-layer run's own mean is recorded), peak GPU memory
        ≤ 1.5 × the plan's estimate.
        The whole run (loading, the pass, the packed output written) is projected to 48 layers by what grows
        with them (``pass_figures``: the added layers at the pace and utilisation of a layer after the first, and
        the write by its decoder layers' share of the output's bytes, ``layer_bytes_share``; start-up, the first
        layer's warm-up and the embeddings' and head's write happen once) and held to the same 10 minutes:
        packing thousands of experts is the writer's work, on the GPU when there is one. Also recorded: every
        expert's method in ``quantization_log.csv`` (none left unquantized), and that stacked experts and a
        linear packed on the device (``checkpoint_writer``'s ``pack_device``) equal those packed on the host, bit
        for bit, in every packing format.

The checkpoint is drawn on the device (seconds on a GPU) and written by transformers' own ``save_pretrained``
(the Hub's layout for the installed transformers), with SmolLM2's tokenizer and vocabulary (49152; the
original's 151936 only changes the embeddings). ``--tiny``: 2 layers of a 8-expert toy of the same family.
"""
from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.acceptance.runs import GOAL_GPU_BUSY, GOAL_GPU_OVER_ESTIMATE, LegError, apply_recipe, busy_between, row
from benchmarks.acceptance.stream8b import device_estimate

QWEN3_30B_A3B_LAYERS = 48
QWEN3_30B_A3B = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=49152, tie_word_embeddings=False, norm_topk_prob=True)
TINY_MOE = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=49152, tie_word_embeddings=False, norm_topk_prob=True)
TINY_MOE_LAYERS = 2
GOAL_MOE_48_LAYERS_S = 10 * 60


def output_write_s(seconds: dict) -> float:
    """The output's write from its timings record's phases: units read, packed and written (an engine before the
    split has only ``write``)."""
    return sum(seconds.get(phase, 0.0) for phase in ("read", "pack", "write"))


def write_moe_checkpoint(directory: Path, layers: int, device: str, tokenizer: str, shape: dict) -> Path:
    """A Qwen3-MoE checkpoint of ``shape`` with ``layers`` decoder layers, random weights (std 0.02, seed 0)
    drawn on ``device``; written into a temporary directory renamed into place, skipped when complete."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    from recipe_engine.sources.models import resolve_model

    if (directory / "config.json").is_file():
        return directory
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    config = Qwen3MoeConfig(num_hidden_layers=layers, max_position_embeddings=4096, initializer_range=0.02, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    del model
    source = tokenizer if Path(tokenizer).is_dir() else resolve_model(tokenizer).location
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    tmp.rename(directory)
    return directory


def moe_recipe(args, model: Path, work: Path) -> dict:
    gptq = {"bits": 4, "group_size": 32 if args.tiny else 128}  # the packed default (compressed-tensors)
    samples, seq_len, batch = (4, 64, 2) if args.tiny else (args.samples, args.seq_len, 4)
    return {"version": 1, "name": "moe", "model": str(model), "dtype": "bfloat16", "device": args.device,
            "stream": "on", "calibration": {"dataset": "wikipedia-sample", "split": "train", "samples": samples,
                                            "seq_len": seq_len, "batch_size": batch, "seed": 0},
            "modifiers": [{"GPTQ": gptq}], "output": str(work / "moe-out")}


def packed_on_device_equal_host(device: str) -> bool:
    """Stacked experts ``[4, 256, 512]`` and a ``[256, 512]`` linear in bf16, on 4-bit grids (symmetric and
    asymmetric, groups of 128), packed by the checkpoint writer on ``device`` and on the host: the same tensors
    bit for bit, for every packing format."""
    import torch

    from recipe_engine.checkpoint.writer import _stored
    from recipe_engine.formats import checkpoint_exporter, checkpoint_formats
    from recipe_engine.numerics.quantization import Grid, QuantizedLinear

    def split(name, tensor):  # stacked experts → one linear per expert (the Hub's per-expert names)
        if tensor.dim() == 2:
            return {name: tensor}
        return {f"{name[:-len('.weight')]}.{e}.weight": tensor[e] for e in range(tensor.shape[0])}

    generator = torch.Generator().manual_seed(0)
    for format in checkpoint_formats():
        exporter = checkpoint_exporter(format)
        for sym in (True, False):
            if not exporter.packs or exporter.grid_problem(4, sym):
                continue
            grid = Grid(4, 128, sym, exporter.scale_dtype(torch.bfloat16))
            for shape in ((4, 256, 512), (256, 512)):
                w = (0.05 * torch.randn(shape, generator=generator, dtype=torch.float64))
                scale, zero = grid.params(w.reshape(*shape[:-1], -1, 128))
                fake = grid.fake(w, grid.expand(scale.reshape(-1, scale.shape[-1]), 512).reshape(shape),
                                 grid.expand(zero.reshape(-1, zero.shape[-1]), 512).reshape(shape))
                record = QuantizedLinear(grid, scale.float(), zero.to(torch.int16), format=format,
                                         parameter="weight" if len(shape) == 2 else "experts")
                weight = fake.to(torch.bfloat16)
                here = _stored("m.weight", weight, {"m.weight": record}, split, torch.device("cpu"))
                there = _stored("m.weight", weight, {"m.weight": record}, split, torch.device(device))
                if here.keys() != there.keys() or not all(
                        torch.equal(here[k].cpu(), there[k].cpu()) and here[k].dtype == there[k].dtype
                        for k in here):
                    return False
    return True


def bare_runtime_host_gib(device: str, compute: bool = True) -> float:
    """Resident host memory (GiB) of a fresh process that imported torch and (``compute``) ran a Cholesky and a
    matmul on ``device``: the accelerator runtime's share of a run's host memory (its libraries and context)
    is the difference between the two, which ``recipe plan`` counts as ``ACCELERATOR_RUNTIME_BYTES``."""
    work = ("d = torch.device(%r); x = torch.randn(256, 256, device=d, dtype=torch.float64); "
            "torch.linalg.cholesky(x @ x.T + 256 * torch.eye(256, device=d, dtype=torch.float64)); "
            "(x.float() @ x.float()).sum().item(); " % device) if compute else ""
    code = ("import torch, pathlib; " + work + "print(next(l for l in pathlib.Path('/proc/self/status')"
            ".read_text().splitlines() if l.startswith('VmRSS')).split()[1])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return round(int(run.stdout.split()[-1]) / 2**20, 3)


def layer_bytes_share(directory: Path) -> float:
    """The decoder layers' share of a checkpoint's tensor bytes (names with ``.layers.``; from the safetensors
    headers): the part of its write that grows with the layers (the embeddings and head are written once)."""
    layers = total = 0
    for path in directory.glob("*.safetensors"):
        with open(path, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                size = entry["data_offsets"][1] - entry["data_offsets"][0]
                total += size
                layers += size if ".layers." in name else 0
    return layers / total if total else 1.0


def host_high_water_gib(timings_path: Path) -> dict[str, float]:
    """The run's host high-water mark (GiB) by part, from the timings log: the layer-sequential pass (its layer
    records) and the output's write (the ``output written`` record): which of the two set the peak."""
    from recipe_engine.execution.timings import read_timings

    records = read_timings(timings_path) if timings_path.is_file() else []
    parts = {"pass": [r for r in records if "layer" in r], "write": [r for r in records
                                                                      if r.get("event") == "output written"]}
    return {part: round(max(r["host_high_water_mib"] for r in found) / 1024, 3)
            for part, found in parts.items() if found and all("host_high_water_mib" in r for r in found)}


def pass_figures(result: dict, total_layers: int, write_s: float, write_share: float) -> dict:
    """The run's layer-sequential pass and the whole run extrapolated to ``total_layers``, from the timings log
    (its wall clock, ``unix_s``) and the GPU trace:

    - ``pass_gpu_busy``: utilisation from the first layer's start to the last layer's end;
    - ``steady_layer_s``, ``steady_gpu_busy``: a layer after the first (from the first layer's end to the last's:
      the first also starts the GPU's libraries and captures the block programs, once a run) and its utilisation;
    - ``whole_run_s``: the run's wall plus the layers it lacks at the steady pace and their part of the output's
      write (the write × ``write_share``, the decoder layers' share of its bytes, per run of the measured size;
      the embeddings and head are written once); ``whole_run_gpu_busy``: the run's busy seconds plus the added
      layers' at the steady utilisation (the added write idle), over ``whole_run_s``.

    A figure that cannot be made (no trace, one layer) is None."""
    from recipe_engine.execution.timings import read_timings

    figures = dict.fromkeys(("pass_gpu_busy", "steady_layer_s", "steady_gpu_busy", "whole_run_s",
                             "whole_run_gpu_busy"))
    path = Path(result["timings_path"])
    layers = [r for r in read_timings(path) if "layer" in r and "unix_s" in r] if path.is_file() else []
    if not layers:
        return figures
    added = total_layers - len(layers)
    start = layers[0]["unix_s"] - sum(layers[0]["seconds"].values())
    figures["pass_gpu_busy"], _ = busy_between(result.get("trace_path"), start, layers[-1]["unix_s"])
    if len(layers) > 1:
        figures["steady_layer_s"] = (layers[-1]["unix_s"] - layers[0]["unix_s"]) / (len(layers) - 1)
        figures["steady_gpu_busy"], _ = busy_between(result.get("trace_path"), layers[0]["unix_s"],
                                                     layers[-1]["unix_s"])
    if added and figures["steady_layer_s"] is None:
        return figures
    added_s = added * (figures["steady_layer_s"] or 0.0)
    figures["whole_run_s"] = result["wall_s"] + added_s + write_s * write_share * added / len(layers)
    if result["gpu_busy"] is not None and (figures["steady_gpu_busy"] is not None or not added):
        busy_s = result["gpu_busy"] * result["wall_s"] + (figures["steady_gpu_busy"] or 0.0) * added_s
        figures["whole_run_gpu_busy"] = round(busy_s / figures["whole_run_s"], 3)
    for key in ("steady_layer_s", "whole_run_s"):
        figures[key] = None if figures[key] is None else round(figures[key], 2)
    return figures


def leg_moe(args, work: Path) -> tuple[dict, list[dict]]:
    from recipe_engine.sources.models import load_config

    started = time.perf_counter()
    shape, layers = (TINY_MOE, TINY_MOE_LAYERS) if args.tiny else (QWEN3_30B_A3B, args.moe_layers)
    model = write_moe_checkpoint(work / ("tiny-qwen3-moe-bf16" if args.tiny else f"qwen3-30b-a3b-{layers}-bf16"),
                                 layers, args.device, args.tokenizer, shape)
    written_s = time.perf_counter() - started
    recipe = moe_recipe(args, model, work)
    result = apply_recipe(recipe, work, timeout=600 if args.tiny else 1500, trace=True,
                          profile=getattr(args, "profile", False))
    report = result["report"]
    with open(Path(recipe["output"]) / "quantization_log.csv") as handle:
        log = list(csv.DictReader(handle))
    experts = [r for r in log if "experts." in r["module"]]
    if not experts:
        raise LegError("quantization_log.csv lists no expert: the experts were not quantized")
    methods = Counter(r["method"] for r in experts)
    gptq_s = sum(s.wall_s for s in report.steps if s.modifier == "GPTQ")
    shared = max((s.pass_shared_s for s in report.steps if s.shared_pass), default=0.0)
    per_layer = (gptq_s + shared) / layers
    scale_up = 1.0 if args.tiny else QWEN3_30B_A3B_LAYERS / layers
    estimate = device_estimate(recipe, load_config(str(model)), report.activations_on not in (None, "cpu"))
    gpu_mib = report.peak_memory.cuda_mib
    busy = result["gpu_busy"]
    on_gpu = report.device.startswith("cuda")
    figures = {"checkpoint_gib": round(sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**30, 3),
               "checkpoint_written_s": round(written_s, 1), "apply_wall_s": round(result["wall_s"], 1),
               "gptq_step_s": round(gptq_s, 2), "pass_shared_s": round(shared, 2), "model_layers": layers,
               "per_layer_s": round(per_layer, 2), "calibration": f"{recipe['calibration']['samples']} x "
               f"{recipe['calibration']['seq_len']}", "expert_rows": len(experts), "expert_methods": dict(methods),
               "log_rows": len(log), "peak_gpu_mib": gpu_mib, "gpu_estimate_mib": round(estimate["bytes"] / 2**20, 1),
               "peak_host_gib": round((result["watched_peak_mib"] or report.peak_memory.rss_mib) / 1024, 3),
               "timings": result["timings"], "gpu_busy": busy, "device": report.device}
    write_s = output_write_s(result["timings"].get("seconds_by_step", {}).get("", {}))
    share = layer_bytes_share(Path(recipe["output"]))
    passed = pass_figures(result, round(layers * scale_up), write_s, share)
    whole_run, pass_busy, whole_busy_48 = (passed["whole_run_s"], passed["pass_gpu_busy"],
                                           passed["whole_run_gpu_busy"])
    figures.update(output_write_s=round(write_s, 1), output_layer_share=round(share, 3),
                   whole_run_48_layers_s=whole_run, pass_gpu_busy=pass_busy,
                   steady_layer_s=passed["steady_layer_s"], steady_gpu_busy=passed["steady_gpu_busy"],
                   whole_run_48_layers_gpu_busy=whole_busy_48)
    alike = packed_on_device_equal_host(args.device)
    figures.update(report_peak_host_gib=round(report.peak_memory.rss_mib / 1024, 3),
                   host_estimate_gib=round(report.peak_memory.estimate_rss_mib / 1024, 3),
                   bare_runtime_host_gib=bare_runtime_host_gib(args.device),
                   bare_import_host_gib=bare_runtime_host_gib(args.device, compute=False),
                   host_high_water_gib=host_high_water_gib(Path(result["timings_path"])))
    label = f"48 layers, {layers} x {scale_up:g}" if scale_up != 1 else f"{layers} layers"
    if not args.keep_work:  # ~20 GB in /dev/shm: the later legs' checkpoints need the room
        shutil.rmtree(recipe["output"], ignore_errors=True)
        shutil.rmtree(model, ignore_errors=True)
    whole = per_layer * (QWEN3_30B_A3B_LAYERS if not args.tiny else layers)
    rows = [row("moe", f"GPTQ W4 g128 on every expert, Qwen3-30B-A3B-shaped, {label}", round(whole, 1), "s",
                f"<= {GOAL_MOE_48_LAYERS_S} (one GPU)", whole <= GOAL_MOE_48_LAYERS_S if on_gpu else None,
                measured_s=round(gptq_s + shared, 1)),
            row("moe", f"whole run: loading, the pass, the packed output written ({label}; the added layers at "
                f"the steady pace)", whole_run, "s", f"<= {GOAL_MOE_48_LAYERS_S} (one GPU)",
                whole_run <= GOAL_MOE_48_LAYERS_S if on_gpu and whole_run is not None else None,
                measured_s=round(result["wall_s"], 1), output_write_s=round(write_s, 1)),
            row("moe", "GPU busy (nvidia-smi utilisation, mean over the apply run)", busy, "", "recorded (no goal)",
                None),
            row("moe", "GPU busy during the layer-sequential pass (its layers, from the timings log's clock)",
                pass_busy, "", f">= {GOAL_GPU_BUSY}",
                pass_busy >= GOAL_GPU_BUSY if on_gpu and pass_busy is not None else None),
            row("moe", "GPU busy in a layer after the first (the steady pace), and its seconds",
                f"{passed['steady_gpu_busy']} / {passed['steady_layer_s']}", "", "recorded (no goal)", None),
            row("moe", f"GPU busy over the whole run extrapolated to 48 layers ({label})", whole_busy_48, "",
                f">= {GOAL_GPU_BUSY}", whole_busy_48 >= GOAL_GPU_BUSY if on_gpu and whole_busy_48 is not None
                else None),
            row("moe", f"peak host GiB: watched, report, plan; the pass's, the write's; a bare process on "
                f"{args.device}, importing torch only",
                " / ".join(str(figures[k]) for k in ("peak_host_gib", "report_peak_host_gib", "host_estimate_gib"))
                + "; " + " / ".join(str(figures["host_high_water_gib"].get(k)) for k in ("pass", "write"))
                + "; " + " / ".join(str(figures[k]) for k in ("bare_runtime_host_gib", "bare_import_host_gib")),
                "GiB", "recorded (no goal)", None),
            row("moe", "peak GPU memory / plan's estimate", round(gpu_mib * 2**20 / estimate["bytes"], 3)
                if gpu_mib else None, "x", f"<= {GOAL_GPU_OVER_ESTIMATE}",
                gpu_mib * 2**20 <= GOAL_GPU_OVER_ESTIMATE * estimate["bytes"] if gpu_mib else None),
            row("moe", "experts quantized (quantization_log.csv rows; none left in bf16)", len(experts), "",
                "every expert", sum(methods.values()) == len(experts), methods=dict(methods)),
            row("moe", f"experts packed on {args.device} equal those packed on the host", alike, "",
                "identical", alike)]
    return figures, rows
