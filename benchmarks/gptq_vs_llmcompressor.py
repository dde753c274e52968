"""Our GPTQ step vs llm-compressor 0.14 ``oneshot`` + ``GPTQModifier`` on SmolLM2-135M, W4 g64, CPU.

Both sides quantize the same dense checkpoint with the same calibration token ids (32 × 512 from
WikiText-2 validation, saved to a file both read), at the same time with one thread each (the machine is
shared; load then slows both alike), and are scored by the same function
(``recipe_engine.evaluation.perplexity``, WikiText-2 test, 24 windows × 1024) in this process.
llm-compressor runs in its own venv (``.venv-llmc``, its pins differ) as a subprocess of this script
(``--side llmcompressor``); its dequantized weights come back as a safetensors file.

Run (from the repository root, main venv; a few CPU minutes per side):
    nice -n 10 python -m benchmarks.gptq_vs_llmcompressor --out benchmarks/results/gptq_vs_llmc
``--llmc-ppl X`` compares with llm-compressor's recorded PPL for the same seed instead
(its side is deterministic for a given sample), for machines without ``.venv-llmc``.
``--seed`` draws another calibration sample (GPTQ's PPL moves by ~1 % with the sample, and even with
~1e-6 changes of H, so compare over seeds); ``--variants`` picks which of our settings run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def llmcompressor_side(args) -> None:
    """Runs under .venv-llmc: oneshot GPTQ, then save dense dequantized weights and the wall time."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ids = torch.load(args.calibration)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": args.group_size}
    recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                          ignore=["lm_head"], dampening_frac=0.01, block_size=128)
    start, cpu = time.perf_counter(), time.process_time()
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=ids.shape[0],
            max_seq_length=ids.shape[1], batch_size=args.batch_size, shuffle_calibration_samples=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    record = {"wall_s": wall, "cpu_s": cpu, "actorder": str(recipe.actorder)}
    Path(args.result, "llmc.json").write_text(json.dumps(record))
    state = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and scheme.weights is not None:
            if getattr(module, "weight_g_idx", None) is not None:
                raise RuntimeError(f"{name}: g_idx (actorder=group) is not handled here")
            state[f"{name}.weight"] = fake_quantize(module.weight, module.weight_scale, module.weight_zero_point,
                                                    scheme.weights).detach().contiguous()
    save_file(state, str(Path(args.result) / "llmc_quantized_linears.safetensors"))


def session_for(model, tokenizer, ids, batch_size: int):
    from recipe_engine.architectures.adapters import adapter_for
    from recipe_engine.recipe.schema import CalibrationConfig
    from recipe_engine.execution.context import RunContext
    from recipe_engine.execution.session import Session

    config = CalibrationConfig(samples=ids.shape[0], seq_len=ids.shape[1], batch_size=batch_size)
    return Session(RunContext(tokenizer, adapter_for(model.config), config, torch.device("cpu")), model, ids)


#: our variants: name → GPTQ parameters besides bits 4, sym, the group size and the export
OURS = {"ours_default": {},
        "ours_act_order_true": {"act_order": True, "sequential": False},
        "ours_sequential": {"act_order": True, "sequential": True},
        "ours_act_order_false": {"act_order": False, "sequential": False}}


def ours(model, tokenizer, ids, group_size: int, options: dict, batch_size: int):
    """Our GPTQ step in a layer-sequential session over the given ids; returns (wall s, CPU s, session)."""
    from recipe_engine.modifiers.gptq import GPTQ

    session = session_for(model, tokenizer, ids, batch_size)
    step = GPTQ(bits=4, group_size=group_size, sym=True, export="compressed-tensors", **options)
    start, cpu = time.perf_counter(), time.process_time()
    session.pipeline.run_layer_modifiers([step])
    return time.perf_counter() - start, time.process_time() - cpu, session


def ppl(model, tokenizer, text: str, windows: int) -> float:
    from recipe_engine.evaluation.perplexity import perplexity

    return perplexity(model, tokenizer, text, seq_len=1024, limit=windows)["ppl"]


def disk_mb(directory: Path) -> float:
    from recipe_engine.sources.sizes import checkpoint_bytes

    return checkpoint_bytes(directory) / 2 ** 20


def prepare(args, out: Path):
    """Dense checkpoint (for llm-compressor) and the shared calibration ids, saved under ``out``."""
    from recipe_engine.sources.text import load_text
    from recipe_engine.sources.windows import sample_windows, tokenize
    from recipe_engine.sources.models import load_model

    dense, tokenizer, _ = load_model("smollm2-135m", "float32")
    dense.save_pretrained(out / "dense")
    tokenizer.save_pretrained(out / "dense")
    calibration = load_text("wikitext2", "validation")
    ids = sample_windows(tokenize(tokenizer, calibration.text), args.samples, args.seq_len, args.seed,
                         calibration.origin)
    torch.save(ids, out / "calibration_ids.pt")
    return dense, tokenizer, ids, f"{calibration.origin}: {args.samples} x {args.seq_len}, seed {args.seed}"


def main_side(args) -> None:
    """Both sides quantize at the same time (one thread each, so a shared machine's load hits both
    alike); then every model is scored here, one after another."""
    import copy

    from recipe_engine.modifiers.quantize import Quantize
    from recipe_engine.checkpoint.writer import write_checkpoint
    from recipe_engine.sources.text import load_text
    from safetensors.torch import load_file

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dense, tokenizer, ids, origin = prepare(args, out)
    command = [str(ROOT / ".venv-llmc" / "bin" / "python"), __file__, "--side", "llmcompressor",
               "--model", str(out / "dense"), "--calibration", str(out / "calibration_ids.pt"), "--result",
               str(out), "--group-size", str(args.group_size), "--batch-size", str(args.batch_size),
               "--threads", "1"]
    theirs_process = None if args.llmc_ppl else subprocess.Popen(command)
    torch.set_num_threads(1)
    models, results = {}, {"calibration": origin, "threads_while_quantizing": 1}
    ours_keys = args.variants or list(OURS)
    for key in ours_keys:
        options = OURS[key]
        models[key] = copy.deepcopy(dense)
        wall, cpu, session = ours(models[key], tokenizer, ids, args.group_size, options, args.batch_size)
        (out / key).mkdir(exist_ok=True)
        write_checkpoint(session, out / key)
        results[key] = {"wall_s": wall, "cpu_s": cpu, "packed_mb": disk_mb(out / key)}
        print(json.dumps({key: results[key]}), flush=True)
    if theirs_process is not None:
        if theirs_process.wait() != 0:
            raise RuntimeError(f"llm-compressor side failed (exit {theirs_process.returncode})")
        models["llmcompressor"] = copy.deepcopy(dense)
        quantized = load_file(str(out / "llmc_quantized_linears.safetensors"))
        _, unexpected = models["llmcompressor"].load_state_dict(quantized, strict=False)
        assert not unexpected and len(quantized) == 7 * dense.config.num_hidden_layers, unexpected
        results["llmcompressor"] = json.loads((out / "llmc.json").read_text())
    else:  # a recorded run on the same ids (its side is deterministic for a given sample)
        results["llmcompressor_recorded"] = {"ppl": args.llmc_ppl, "source": "--llmc-ppl (BENCHMARKS.md)"}
    models["rtn"] = copy.deepcopy(dense)
    Quantize(bits=4, group_size=args.group_size).apply(session_for(models["rtn"], tokenizer, ids, args.batch_size))
    models["dense"], results["rtn"], results["dense"] = dense, {}, {"dense_mb": disk_mb(out / "dense")}
    torch.set_num_threads(args.threads)
    test = load_text("wikitext2", "test").text
    for key in (*models.keys() & {"llmcompressor"}, *ours_keys, "dense", "rtn"):
        results[key]["ppl"] = ppl(models[key], tokenizer, test, args.windows)
        print(json.dumps({key: results[key]}), flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    theirs = results.get("llmcompressor") or results["llmcompressor_recorded"]
    for key in ours_keys:
        results[key]["ppl_ratio_vs_llmc"] = results[key]["ppl"] / theirs["ppl"]
        if "llmcompressor" in results:  # CPU clocks compare only within one run
            for clock in ("wall_s", "cpu_s"):
                results[key][f"{clock}_ratio_vs_llmc"] = results[key][clock] / theirs[clock]
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["ours", "llmcompressor"], default="ours")
    parser.add_argument("--out", default="benchmarks/results/gptq_vs_llmc")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the calibration window sample")
    parser.add_argument("--variants", nargs="+", choices=list(OURS), help="our variants to run (default: all)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--windows", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llmc-ppl", type=float, help="llm-compressor's recorded PPL for this seed (BENCHMARKS.md): "
                        "compare with it instead of running llm-compressor (no .venv-llmc)")
    parser.add_argument("--model")
    parser.add_argument("--calibration")
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.side == "llmcompressor":
        llmcompressor_side(args)
    else:
        main_side(args)


if __name__ == "__main__":
    main()
