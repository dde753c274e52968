"""Scale-up benchmarks: peak host memory of streamed runs on synthetic Llama-shaped checkpoints.

Synthetic checkpoints have a real architecture's shapes and seeded random weights (N(0, 0.02²), norms 1),
written shard by shard (one layer per file) so that writing one never holds the model. Their quality
means nothing; their memory and time are real. The tokenizer is SmolLM2's (ids < 49152 fit every vocab).

  python -m benchmarks.scale depth            # 1: hidden 1024, 8/16/32 layers, FlattenGPT n = L/8
  python -m benchmarks.scale large            # 2: Llama-3-8B shapes in fp32 (~32 GB), FlattenGPT n=1 + GPTQ
  python -m benchmarks.scale equal            # 3: SmolLM2 in memory vs streamed: identical weights

Each run is a subprocess (`python -m recipe_engine.cli apply`); its peak RSS is read from /proc while it
runs (VmHWM) and from report.json; `recipe plan`'s estimate is recorded beside it. Results go to
benchmarks/results/raw/scale-<bench>.json and a table on stdout.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

import recipe_engine
from recipe_engine.sources.sizes import checkpoint_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "raw"   # raw output (ignored by git)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0)
DEPTH = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
             vocab_size=49152, tie_word_embeddings=False)


def write_synthetic(directory: Path, layers: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                    device: str = "cpu", tokenizer: str = "smollm2-135m", **shape) -> Path:
    """A Llama checkpoint with ``layers`` decoder layers of ``shape``, one safetensors shard per layer
    (plus one for embeddings, one for norm + lm_head) and an index; skipped when already complete.
    ``device`` draws the random weights there (a GPU draws an 8B model's in seconds; other numbers).
    ``tokenizer``: a model alias or a directory holding tokenizer files (SmolLM2's by default)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from recipe_engine.sources.models import resolve_model

    if (directory / "model.safetensors.index.json").is_file():
        return directory
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         dtype=str(dtype).split(".")[1], **shape)
    config.save_pretrained(tmp)
    source = tokenizer if Path(tokenizer).is_dir() else resolve_model(tokenizer).location
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    d = h // config.num_attention_heads
    kv = config.num_key_value_heads * d
    generator = torch.Generator(device).manual_seed(seed)

    def randn(*size):
        return (torch.randn(*size, generator=generator, device=device) * 0.02).to(dtype).cpu()

    units = [{"model.embed_tokens.weight": randn(v, h)}]
    shapes = {"self_attn.q_proj.weight": (config.num_attention_heads * d, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, config.num_attention_heads * d),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    files = [f"model-{k + 1:05d}-of-{layers + 2:05d}.safetensors" for k in range(layers + 2)]
    weight_map, total = {}, 0

    def save(index: int, tensors: dict) -> None:
        nonlocal total
        save_file(tensors, str(tmp / files[index]), metadata={"format": "pt"})
        weight_map.update({name: files[index] for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    save(0, units[0])
    del units
    for layer in range(layers):
        tensors = {f"model.layers.{layer}.{name}": randn(*size) for name, size in shapes.items()}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = torch.ones(h, dtype=dtype)
        save(layer + 1, tensors)
        del tensors
    save(layers + 1, {"model.norm.weight": torch.ones(h, dtype=dtype), "lm_head.weight": randn(v, h)})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    os.replace(tmp, directory)
    return directory


def _watch_rss(pid: int, peak: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak["hwm_mib"] = max(peak.get("hwm_mib", 0), int(line.split()[1]) / 1024)
        except OSError:
            return
        stop.wait(1.0)


def plan_estimate(recipe_path: Path) -> dict:
    """`recipe plan --json`'s memory estimate for the recipe."""
    run = subprocess.run([sys.executable, "-m", "recipe_engine.cli", "plan", str(recipe_path), "--json"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(run.stdout)["memory"]


def apply(recipe: dict, workdir: Path, log_name: str, *options: str) -> dict:
    """Run ``recipe`` in a subprocess (``recipe apply`` with ``options``); returns its report plus the watched
    peak RSS and wall time."""
    path = workdir / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    estimate = plan_estimate(path)
    log = (workdir / log_name).open("w")
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "recipe_engine.cli", "apply", str(path), "--force", *options],
                               stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    peak: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_rss, args=(process.pid, peak, stop), daemon=True)
    watcher.start()
    code = process.wait()
    stop.set()
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{recipe['name']} failed (exit {code}); see {workdir / log_name}")
    report = recipe_engine.load_report(recipe["output"])
    return {"report": report, "watched_peak_mib": peak.get("hwm_mib"), "wall_s": wall, "estimate": estimate}


def base_recipe(name: str, model: Path, output: Path, steps: list, samples: int, seq_len: int,
                stream: str = "on", dtype: str = "float32") -> dict:
    return {"version": 1, "name": name, "model": str(model), "dtype": dtype, "device": "cpu", "stream": stream,
            "calibration": {"dataset": "wikipedia-sample", "samples": samples, "seq_len": seq_len,
                            "batch_size": 4}, "modifiers": steps, "output": str(output)}


def _gib(mib: float | None) -> float | None:
    return None if mib is None else round(mib / 1024, 3)


def row(label: str, result: dict, size: int) -> dict:
    report = result["report"]
    peak = report.peak_memory.rss_mib
    return {"run": label, "checkpoint_gib": size / 2**30, "peak_rss_gib": peak / 1024,
            "peak_over_checkpoint": peak * 2**20 / size, "estimate_gib": result["estimate"]["host_peak_bytes"] / 2**30,
            "estimate_over_peak": result["estimate"]["host_peak_bytes"] / (peak * 2**20), "wall_s": result["wall_s"],
            "steps_s": {f"{s.index} {s.modifier}": round(s.wall_s, 1) for s in report.steps},
            "steps_peak_gib": {f"{s.index} {s.modifier}": _gib(s.peak_rss_mib) for s in report.steps},
            "steps_estimate_gib": {f"{s.index} {s.modifier}": _gib(s.estimate_rss_mib)
                                   for s in report.steps},
            "pass_shared_s": max(s.pass_shared_s for s in report.steps),
            "layers": f"{report.before.layers} -> {report.after.layers}",
            "bytes_staged_gib": (report.stream.bytes_staged if report.stream else 0) / 2**30}


def bench_depth(workdir: Path, layers: list[int]) -> list[dict]:
    rows = []
    for count in layers:
        model = write_synthetic(workdir / f"llama-depth-{count}", count, **DEPTH)
        steps = ["FuseNorm", f"FlattenAdjacent<n:{count // 8}>", "HeadPrune", "NystromMLP"]
        result = apply(base_recipe(f"depth{count}", model, workdir / f"out-depth{count}", steps, 8, 256),
                       workdir, f"depth{count}.log")
        rows.append(row(f"{count} layers", result, checkpoint_bytes(model)))
        shutil.rmtree(workdir / f"out-depth{count}")
    base = rows[0]["peak_rss_gib"]
    for r in rows:
        r["peak_over_first"] = r["peak_rss_gib"] / base
    return rows


def bench_large(workdir: Path, steps: list[str]) -> list[dict]:
    model = write_synthetic(workdir / "llama3-8b-fp32", 32, **LLAMA3_8B)
    # --no-checkpoints: the disk holds the 30 GiB source and one 29 GiB output, not a second staged copy
    result = apply(base_recipe("llama3_8b_stream", model, workdir / "out-8b", steps, 4, 256), workdir, "8b.log",
                   "--no-checkpoints")
    out = row("Llama-3-8B shapes, fp32", result, checkpoint_bytes(model))
    out["output_gib"] = checkpoint_bytes(workdir / "out-8b") / 2**30
    shutil.rmtree(workdir / "out-8b")
    return [out]


def file_digest(directory: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    digests = {}
    for file in sorted(directory.glob("model*.safetensors")):
        for name, tensor in load_file(file).items():
            digests[name] = hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return digests


def bench_equal(workdir: Path, samples: int) -> list[dict]:
    steps = ["FuseNorm", "FlattenAdjacent<n:6>", "HeadPrune", "NystromMLP"]
    rows, digests = [], []
    for stream in ("off", "on"):
        output = workdir / f"out-smollm2-{stream}"
        result = apply(base_recipe(f"smollm2_{stream}", Path("smollm2-135m"), output, steps, samples, 512, stream),
                       workdir, f"smollm2-{stream}.log")
        from recipe_engine.sources.models import resolve_model

        r = row(f"SmolLM2 stream {stream}", result, checkpoint_bytes(Path(resolve_model("smollm2-135m").location)))
        digests.append(file_digest(output))
        rows.append(r)
    same = digests[0] == digests[1]
    for r in rows:
        r["identical_weights"] = same
        r["tensors"] = len(digests[0])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", choices=["depth", "large", "equal"])
    parser.add_argument("--workdir", default=os.environ.get("RECIPE_SCALE_DIR", "/tmp/recipe-scale"),
                        help="synthetic checkpoints and outputs (not in the repo)")
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--samples", type=int, default=32, help="calibration windows for `equal`")
    parser.add_argument("--steps", nargs="+", default=["FlattenAdjacent<n:1>", "HeadPrune", "NystromMLP",
                                                       "GPTQ<bits:4,group_size:128>"], help="recipe of `large`")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    rows = {"depth": lambda: bench_depth(workdir, args.layers), "large": lambda: bench_large(workdir, args.steps),
            "equal": lambda: bench_equal(workdir, args.samples)}[args.bench]()
    meta = {"bench": args.bench, "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
            f"{os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
            "command": " ".join(sys.argv)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"scale-{args.bench}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    per_step = ("steps_s", "steps_peak_gib", "steps_estimate_gib")
    keys = [k for k in rows[0] if k not in per_step]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys))
        for key in per_step:
            print(f"   {key}:", r.get(key))


if __name__ == "__main__":
    main()
