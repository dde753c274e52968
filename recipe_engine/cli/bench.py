"""``recipe bench``: a rich table of the two models' speed and size on stdout, the full record as JSON."""
from __future__ import annotations

import argparse
import time
from importlib.metadata import version

from rich.markup import escape
from rich.table import Table

from ..architectures.adapters import adapter_for
from ..errors import RecipeError
from ..evaluation.bench import (MODES, BenchPlan, bench, check_memory, check_packed, load_packed, packed_config,
                                planned_weight_bytes, protocol_note, ratios, shapes)
from ..sources.models import DTYPES, load_model, packed_description, resolve_model
from ..sources.sizes import checkpoint_bytes
from ..plan.preflight import check_device, check_model, check_seq_len, located
from ..recipe.schema import Recipe
from ..system.progress import Console
from .evaluate import JSON_HELP, check_json_path, model_record, non_negative_int, positive_int, write_json

out = Console()


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def limit_line(ratio: dict | None) -> str | None:
    """Each request's decode tokens/s B/A against the memory-bound limit (weight bytes read per token A/B)."""
    if not ratio or not ratio.get("bytes_per_token"):
        return None
    limit = 1 / ratio["bytes_per_token"]
    parts = [f"{name} {r['decode_tokens_per_s_median']:.3f}× = {r['decode_tokens_per_s_median'] / limit:.3f} of it"
             for name, r in ratio.items() if isinstance(r, dict) and "decode_tokens_per_s_median" in r]
    return f"limit of decode tokens/s B/A (weight bytes read per token, A/B): {limit:.3f}×" + \
        (f"; decode tokens/s B/A: {', '.join(parts)}" if parts else "")


def unmeasured(runs: list[dict], device) -> str | None:
    """The line naming what this machine could not measure (a table cell shows "-")."""
    missing = []
    if any(run["peak_device_mib"] is None for run in runs):
        missing.append(f"peak device memory (device {device})")
    busy = [r.get("gpu_busy_decode") for run in runs for r in run["requests"].values() if "tokens_per_s" in r]
    if any(b is None for b in busy):
        missing.append("GPU busy share while decoding (" + ("no GPU" if device.type != "cuda" else
                                                           "neither pynvml nor nvidia-smi") + ")")
    return "not measured: " + ", ".join(missing) if missing else None


def request_rows(name: str, request: dict) -> list[tuple[str, str, str, str | None]]:
    """(label, request key path, format, ratio key) rows of one request."""
    rows = [(f"{name} latency ms, median", "latency_ms.median", "{:.1f}", "latency_speedup_median"),
            (f"{name} latency ms, p90", "latency_ms.p90", "{:.1f}", "latency_speedup_p90")]
    if "tokens_per_s" in request:
        rows[:0] = [(f"{name} tokens/s, median", "tokens_per_s.median", "{:.1f}", "tokens_per_s_median"),
                    (f"{name} tokens/s at p90 time", "tokens_per_s.p90", "{:.1f}", "tokens_per_s_p90")]
        rows += [(f"{name} first token ms, median", "first_token_ms.median", "{:.1f}", None),
                 (f"{name} decode tokens/s, median", "decode_tokens_per_s.median", "{:.1f}",
                  "decode_tokens_per_s_median"),
                 (f"{name} GPU busy while decoding", "gpu_busy_decode", "{:.0%}", None)]
    return rows


def _get(record: dict, path: str):
    for key in path.split("."):
        record = record.get(key) if isinstance(record, dict) else None
    return record


def bench_table(names: list[str], runs: list[dict], ratio: dict | None) -> Table:
    table = Table(title="recipe bench")
    table.add_column("", no_wrap=True)
    for name in names:
        table.add_column(escape(name), justify="right")
    if ratio:
        table.add_column("B/A", justify="right")
    rows = [("parameters", "parameters", "{:,}", "parameters"),
            ("checkpoint bytes", "checkpoint_bytes", "{:,}", "checkpoint_bytes"),
            ("weights", "weights", "{}", None), ("layers", "layers", "{}", None),
            ("weight bytes read per token", "bytes_per_token", "{:,}", "bytes_per_token"),
            ("peak device memory MiB", "peak_device_mib", "{:,.0f}", "peak_device_memory")]
    for label, key, fmt, ratio_key in rows:
        table.add_row(label, *[_cell(run[key], fmt) for run in runs],
                      *([_cell(ratio.get(ratio_key), "{:.3f}×") if ratio_key else ""] if ratio else []))
    for name, request in runs[0]["requests"].items():
        for label, path, fmt, ratio_key in request_rows(name, request):
            table.add_row(label, *[_cell(_get(run["requests"][name], path), fmt) for run in runs],
                          *([_cell(ratio[name].get(ratio_key), "{:.3f}×") if ratio_key else ""] if ratio else []))
    return table


def load_for_bench(spec: str, dtype: str, device):
    """(model, location, weights): a packed int4 checkpoint with the int4 kernel's linears; any other packed
    checkpoint dequantized to ``dtype`` (``weights`` says so); else as loaded."""
    location = resolve_model(spec).location
    if packed_config(location) is not None:
        return load_packed(location, DTYPES[dtype], device), location, "int4 (packed)"
    model, _, source = load_model(spec, dtype)
    return model, source.location, f"{dtype} (dequantized)" if packed_description(source.location) else dtype


def dequantized_line(names: list[str], runs: list[dict], dtype: str) -> str | None:
    """The line naming the packed checkpoints timed dequantized, whose size rows are then those of the
    dequantized weights (None: none is)."""
    which = [f"{name} ({run['packed']})" for name, run in zip(names, runs) if run["packed"]
             and run["weights"] != "int4 (packed)"]
    return (f"timed dequantized to {dtype}: {'; '.join(which)} (the packed kernel takes compressed-"
            f"tensors int4 only); weight bytes read per token count the dequantized weights held, not the "
            f"packed file's") if which else None


#: ``--compile``'s values as the served decode step (``auto`` resolved by the device)
DECODE_STEP_OF = {"on": "compiled", "graphs": "graphs", "off": "eager"}
STEP_WORDS = {"compiled": "compiled", "graphs": "captured as a CUDA graph, no inductor", "eager": "not compiled"}


def warmup_line(names: list[str], runs: list[dict]) -> str | None:
    """The untimed warm-up runs' seconds per model and request (the first compiles or captures the decode step);
    None without warm-up."""
    parts = [f"{name}: " + ", ".join(f"{request} {' + '.join(f'{s:.1f}' for s in r['warmup_s'])} s"
                                      for request, r in run["requests"].items())
             for name, run in zip(names, runs) if any(r.get("warmup_s") for r in run["requests"].values())]
    return f"warm-up (untimed; the first run of each compiles or captures): {'; '.join(parts)}" if parts else None


def preflight(args, device, used) -> None:
    """What ``cmd_bench`` checks of each model before loading any: its config and architecture (the check of
    ``recipe validate``), its longest request against the context, a packed checkpoint against the int4
    kernel, and every request's memory against what is free (``OutOfMemory``, exit 4)."""
    configs, weights = [], []
    for spec in args.dirs:
        config = check_model(spec)
        located(lambda: adapter_for(config), spec)
        check_seq_len(max(s.prompt_tokens + s.gen_tokens for s in used), config, None,
                      option=f"{spec}: the longest request's prompt + new tokens (--prefill-tokens / "
                             f"--prompt-tokens + --gen-tokens): ")
        location = resolve_model(spec).location
        packed = packed_config(location)
        if packed is not None:
            check_packed(spec, packed, device, args.dtype, location)
        if args.mode == "served" and args.compile == "graphs":
            sliding = sorted(set(getattr(config, "layer_types", None) or []) - {"full_attention"})
            if sliding or getattr(config, "use_sliding_window", False):
                raise RecipeError(f"{spec}: --compile graphs keeps one mask for every layer, and this model has "
                                  f"{', '.join(sliding) or 'sliding-window'} layers; use --compile on")
        configs.append(config)
        weights.append(planned_weight_bytes(config, location, DTYPES[args.dtype], packed is not None))
    check_memory(configs, weights, used, DTYPES[args.dtype], device, args.mode == "served")


def cmd_bench(args) -> int:
    if len(args.dirs) > 2:
        raise RecipeError(f"recipe bench takes DIR_A [DIR_B], got {len(args.dirs)} directories")
    check_json_path(args.json, args.dirs)
    device = check_device(args.device)  # the pre-flight of every command (``preflight``), before loading
    on_gpu = device.type == "cuda"
    decode_step = DECODE_STEP_OF[args.compile] if args.compile != "auto" else "compiled" if on_gpu else "eager"
    if args.mode == "served" and decode_step == "graphs" and not on_gpu:
        raise RecipeError(f"--compile graphs captures the decode step as a CUDA graph: it needs a CUDA device, not "
                          f"{device}; use --compile off (or on) here")
    compiled = args.mode == "served" and decode_step == "compiled"
    used = shapes(args.mode, on_gpu, args.batch, args.prompt_tokens, args.gen_tokens, args.prefill_tokens)
    if args.requests:
        unknown = sorted(set(args.requests) - {s.name for s in used})
        if unknown:
            raise RecipeError(f"--requests {' '.join(unknown)}: the {args.mode} mode times "
                              f"{' and '.join(s.name for s in used)}")
        used = tuple(s for s in used if s.name in args.requests)
    preflight(args, device, used)
    loaded = [load_for_bench(spec, args.dtype, device) for spec in args.dirs]
    plan = BenchPlan(args.mode, used, args.warmup, args.repeats, decode_step, device)
    runs = bench([m for m, _, _ in loaded], plan)
    for run, spec, (_, location, weights) in zip(runs, args.dirs, loaded):
        run.update(model=model_record(spec, location), checkpoint_bytes=checkpoint_bytes(location), weights=weights,
                   packed=packed_description(location))
    ratio = ratios(runs[0], runs[1]) if len(runs) == 2 else None
    note = protocol_note(args.mode, used, device.type, decode_step != "eager", args.repeats)
    out.print(bench_table(args.dirs, runs, ratio))
    sizes = "; ".join(f"{s.name}: batch {s.batch} × {s.prompt_tokens}-token prompts"
                      + (f" + {s.gen_tokens} new tokens" if s.gen_tokens else " (one forward pass)") for s in used)
    out.print(f"{args.mode} mode ({'static KV cache, ' if args.mode == 'served' else 'eager generate, '}"
              f"decode step {STEP_WORDS[decode_step]}); {sizes}; median and p90 of "
              f"{args.repeats} interleaved iterations after {args.warmup} warm-up; {device}, {args.dtype}",
              markup=False, highlight=False, soft_wrap=True)
    for line in (dequantized_line(args.dirs, runs, args.dtype), limit_line(ratio), unmeasured(runs, device),
                 warmup_line(args.dirs, runs),
                 f"note: {note}" if note else None):
        if line:
            out.print(line, markup=False, highlight=False, soft_wrap=True)
    write_json(args.json, {"models": runs, "ratio_b_over_a": ratio, "protocol_note": note, "mode": args.mode,
                           "compiled": compiled, "decode_step": decode_step if args.mode == "served" else None,
                           "device": str(device), "dtype": args.dtype,
                           "requests": [vars(s) for s in used], "warmup": args.warmup, "repeats": args.repeats,
                           "torch_version": version("torch"), "date": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return 0


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    dtypes = list(Recipe.model_fields["dtype"].annotation.__args__)
    p = sub.add_parser("bench", help="generation throughput, latency and size (A vs B), as models are served")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="DIR_A [DIR_B]: ratios are B relative to A")
    p.add_argument("--mode", choices=MODES, default="served",
                   help="served: static KV cache, the decode step compiled as CUDA graphs on a GPU, SLEB's "
                        "shapes and batch-1 latency; eager: eager generate and one prefill forward")
    p.add_argument("--compile", choices=["auto", "on", "off", "graphs"], default="auto",
                   help="the served decode step: on = torch.compile (inductor + CUDA graphs; minutes of warm-up on "
                        "an 8B model), graphs = its eager kernels captured as a CUDA graph (no inductor; seconds of "
                        "warm-up; CUDA only), off = eager (auto: on on a GPU; on CPU compiling takes minutes)")
    p.add_argument("--batch", type=positive_int,
                   help="first request's batch (paper 64; CPU default 8); every request's memory is checked against "
                        "what is free before loading (exit 4)")
    p.add_argument("--prompt-tokens", type=positive_int,
                   help="first request's prompt length (served: paper 64; eager: 1)")
    p.add_argument("--gen-tokens", type=positive_int, help="new tokens per request (paper 128; CPU default 32)")
    p.add_argument("--prefill-tokens", type=positive_int,
                   help="second request's prompt length (paper 2048; CPU default 256 served, 512 eager)")
    p.add_argument("--requests", nargs="+", choices=["throughput", "latency", "generation", "prefill"],
                   help="time only these requests (served: throughput latency; eager: generation prefill)")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed runs per model and request (0 or more)")
    p.add_argument("--repeats", type=positive_int, default=30,
                   help="timed iterations per model and request (1 or more)")
    p.add_argument("--dtype", default=Recipe.model_fields["dtype"].default, choices=dtypes)
    p.add_argument("--device", default=Recipe.model_fields["device"].default)
    p.add_argument("--json", metavar="PATH", help=JSON_HELP)
    p.set_defaults(func=cmd_bench)
