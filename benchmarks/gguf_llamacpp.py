"""GGUF export checked by llama.cpp, for every architecture the export writes.

Model groups (``--models``): ``smollm2`` — dense SmolLM2, a FlattenGPT output and a ShortGPT output;
``tiny`` — a tiny random model of each architecture with GGUF facts in its adapter (Llama, Mistral, Qwen2,
Qwen3, Gemma 3 with an irregular sliding-window pattern, its own sliding rope base and a final logit soft-cap,
Phi-3), random norm gains so the norm conventions matter; ``gemma`` — Gemma-3-270M dense and after
``SLEB<n:4, search_samples:2, search_length:64>`` (calibration: 8 windows × 128 tokens of WikiText-2
validation); ``depth20`` — the output of ``recipes/depth20_auto.yaml`` (no evaluation) on each shipped model:
SmolLM2-135M and Qwen2.5-0.5B as the recipe stands, Gemma-3-270M with ``export: {format: gguf}`` (its plain
output keeps ReplaceMe's map as a hook beside the checkpoint, which GGUF cannot hold: export refuses it in one
line; with the export the recipe chooses among the alternatives GGUF can hold), each chosen method recorded.
Each model is written as an HF directory (``recipe apply`` for the compressed ones), exported
with ``recipe export --format gguf`` (f32 and f16; ``--types q8_0`` where llama.cpp's quantized kernels run),
and read by two programs we did not write: llama.cpp through ``llama-cpp-python`` (its own loader and graph;
the same token ids go in) and transformers (``gguf_file=``). Reported per model and type: top-1 agreement of
llama.cpp's next-token prediction with the HF model's over every position of a WikiText-2 test passage
(the tiny models read SmolLM2's token ids of it), mean and max KL(HF ‖ llama.cpp) in nats, the relative logit
errors of llama.cpp and of the transformers read-back (transformers' GGUF reader ignores Gemma 3's layer
pattern, sliding rope base and soft-cap, so it is not an independent check there), and whether llama.cpp's
tokenizer splits the passage into the ids the HF tokenizer gives.

Run (repository root, main venv with ``pip install '.[gguf]'``; ~10 CPU minutes for ``smollm2``, most in
FlattenGPT; ``tiny`` seconds; ``gemma`` a few minutes; ``depth20`` the three recipes, 15–70 minutes each at one
thread, or seconds when OUT/depth20_<model> holds their outputs already):
    nice -n 10 python -m benchmarks.gguf_llamacpp --out benchmarks/results/raw/gguf_llamacpp [--models tiny gemma]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"flattengpt_24": "recipes/flatten20_smollm2.yaml", "shortgpt_24": "recipes/shortgpt_smollm2.yaml"}
GROUPS = ("smollm2", "tiny", "gemma", "depth20")
#: the shipped models the auto recipe runs on; Gemma 3 with an export, so its choice is a stock checkpoint
DEPTH20 = {"smollm2-135m": [], "qwen2.5-0.5b": [], "gemma3-270m": ["export={format: gguf}"]}
#: the SLEB step applied to Gemma-3-270M (a quick search: 2 windows × 64 tokens score each candidate)
GEMMA_SLEB = "SLEB<n:4, search_samples:2, search_length:64>"
#: tiny random models: 4 layers (Gemma 6), GQA 4/2 heads of 16, the SmolLM2 vocabulary (its tokenizer is saved);
#: weights N(0, 0.4²) so next-token distributions are peaked (at transformers' default 0.02 they are nearly
#: uniform over the 49,152 tokens and top-1 agreement would compare near-ties)
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            tie_word_embeddings=False, initializer_range=0.4)
TINY_EXTRA = {
    "mistral": dict(sliding_window=None),
    "qwen3": dict(head_dim=128),  # transformers' GGUF reader takes Qwen3's head_dim from its default, 128
    # window 32 < the prompt, layers 1 and 4 global, sliding layers' own rope base, soft-capped logits
    "gemma3_text": dict(num_hidden_layers=6, sliding_window=32, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                     "sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}),
}


def smollm2_dense(out: Path) -> Path:
    from recipe_engine.sources.models import load_model

    directory = out / "dense"
    if not (directory / "config.json").is_file():
        model, tokenizer, _ = load_model("smollm2-135m", "float32")
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory


def build_smollm2(out: Path) -> dict[str, Path]:
    from recipe_engine import apply

    dirs = {"dense_30": smollm2_dense(out)}
    for name, recipe in RECIPES.items():
        dirs[name] = out / name
        if not (dirs[name] / "config.json").is_file():
            apply(str(ROOT / recipe), overrides=["evaluate=null", f"output={dirs[name]}"], force=True,
                  progress=False)
    return dirs


def build_tiny(out: Path, tokenizer) -> dict[str, Path]:
    """A tiny random model per architecture with GGUF facts, saved with SmolLM2's tokenizer; norm weights
    ``1 + 0.3·N(0, 1)`` (seeded) so the norm conventions (Gemma's ``1 + w``) change the result."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from recipe_engine.architectures.adapters import ADAPTERS
    from recipe_engine.formats.gguf.layout import LAYOUTS

    dirs = {}
    for model_type, adapter in ADAPTERS.items():
        if model_type not in LAYOUTS:
            continue
        dirs[f"tiny_{model_type}"] = directory = out / f"tiny_{model_type}"
        if (directory / "config.json").is_file():
            continue
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer),
                                      **{**TINY, **TINY_EXTRA.get(model_type, {})})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.3 * torch.randn_like(param))
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return dirs


def build_gemma(out: Path) -> dict[str, Path]:
    from recipe_engine import apply
    from recipe_engine.sources.models import load_model

    dirs = {"gemma3_270m_18": out / "gemma3_270m", "gemma3_270m_sleb_14": out / "gemma3_270m_sleb"}
    if not (dirs["gemma3_270m_18"] / "config.json").is_file():
        model, tokenizer, _ = load_model("gemma3-270m", "float32")
        model.save_pretrained(dirs["gemma3_270m_18"])
        tokenizer.save_pretrained(dirs["gemma3_270m_18"])
    if not (dirs["gemma3_270m_sleb_14"] / "config.json").is_file():
        recipe = dict(version=1, name="gemma3_270m_sleb", model=str(dirs["gemma3_270m_18"]), dtype="float32",
                      calibration=dict(dataset="wikitext2", split="validation", samples=8, seq_len=128, seed=0),
                      modifiers=[GEMMA_SLEB], output=str(dirs["gemma3_270m_sleb_14"]))
        apply(recipe, force=True, progress=False)
    return dirs


def build_depth20(out: Path, models: list[str]) -> dict[str, Path]:
    """``recipes/depth20_auto.yaml`` on each of ``models`` (kept when OUT/depth20_<model> is there)."""
    from recipe_engine import apply

    dirs = {}
    for model, extra in ((m, DEPTH20[m]) for m in models):
        dirs[f"depth20_{model}"] = directory = out / f"depth20_{model}"
        if not (directory / "config.json").is_file():
            apply(str(ROOT / "recipes" / "depth20_auto.yaml"),
                  overrides=[f"model={model}", "evaluate=null", f"output={directory}", *extra], force=True,
                  progress=False)
    return dirs


def depth20_choice(directory: Path) -> str:
    """The alternative the auto recipe chose, from the output's report (``BestOf``'s ``chosen``)."""
    result = json.loads((directory / "report.json").read_text())["steps"][0]["result"]
    return result["alternatives"][result["chosen"]]["steps"]


SECTION, ORDER = "GGUF export read by llama.cpp and transformers", 80
SMOLLM2_TABLE, ARCHITECTURE_TABLE = "Same next-token distribution in llama.cpp", "Every architecture in llama.cpp"
DEPTH20_TABLE = "The auto recipe's output on every shipped model, in llama.cpp"
COLUMNS = [{"key": "model", "label": "model"}, {"key": "type", "label": "type"},
           {"key": "top1", "label": "top-1 agreement"}, {"key": "mean", "label": "mean KL"},
           {"key": "max", "label": "max KL"}, {"key": "llama", "label": "llama.cpp rel. logit error"},
           {"key": "hf", "label": "transformers read-back rel. error"}, {"key": "mib", "label": "file MiB"}]
LABELS = {"dense_30": "dense, 30 layers", "flattengpt_24": "FlattenGPT, 24 layers",
          "shortgpt_24": "ShortGPT, 24 layers", "gemma3_270m_18": "Gemma-3-270M dense, 18 layers",
          "gemma3_270m_sleb_14": f"Gemma-3-270M {GEMMA_SLEB}, 14 layers"}


def gguf_name(name: str) -> str:
    """``general.name`` of the exported file. llama.cpp sets Phi-3's token attributes when the model *name*
    contains "phi3" and then requires Phi-3's own ``<s>``, ``</s>`` and ``<unk>`` tokens; a tiny random
    Phi-3-shaped model carries SmolLM2's vocabulary, so its file is named without the architecture."""
    return name.replace("phi3", "p3-shaped")


def table_row(name: str, kind: str, row: dict) -> dict:
    """A measured row in the committed table's format (benchmarks/results/gguf_llamacpp.json)."""
    top1, positions = row["top1_agreement"], row["positions"]
    agree = f"{top1:.4f}" + ("" if top1 == 1 else f" ({round(top1 * positions)}/{positions})")
    cells = {"id": f"{name} {kind}", "model": LABELS.get(name, name.replace("tiny_", "tiny random ")), "type": kind,
             "top1": agree, "mean": f"{row['mean_kl_nats']:.1e}", "max": f"{row['max_kl_nats']:.1e}",
             "llama": f"{row['llamacpp_rel_logit_error']:.1e}",
             "hf": ("0" if row["transformers_readback_rel_error"] == 0
                    else f"{row['transformers_readback_rel_error']:.1e}"),
             "mib": f"{row['gguf_mib']:.1f}"}
    if not name.startswith(tuple(RECIPES) + ("dense_30",)):
        cells["tokens"] = "same" if row["tokenizer_agrees"] else "differ"
    if name.startswith("depth20_"):
        cells["model"] = f"{name.removeprefix('depth20_')}, {row['layers']} layers: {row['chosen']}"
    return cells


def write_rows(path: Path, results: dict, names: list[str], conditions: str) -> None:
    """Upsert the measured rows into the committed result file (SmolLM2 rows into its table, the others into
    the per-architecture one)."""
    from benchmarks.rowstore import run_record, upsert_table_row

    run = run_record(conditions=conditions)
    for key, row in results["models"].items():
        name, kind = key.rsplit(" ", 1)
        if name not in names:
            continue
        smollm2 = name.startswith(tuple(RECIPES) + ("dense_30",))
        columns = COLUMNS if smollm2 else COLUMNS + [{"key": "tokens", "label": "llama.cpp tokenizer ids"}]
        table = SMOLLM2_TABLE if smollm2 else DEPTH20_TABLE if name.startswith("depth20_") else ARCHITECTURE_TABLE
        upsert_table_row(path, table, table_row(name, kind, row), run, "id", section=SECTION, order=ORDER,
                         columns=columns)


def tokenizer_agrees(directory: Path, gguf_file: Path, text: str) -> bool:
    """llama.cpp's tokenizer (from the GGUF alone) gives the HF tokenizer's ids for ``text``, specials included."""
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(directory)(text)["input_ids"]
    llm = Llama(str(gguf_file), vocab_only=True, verbose=False)
    # add_bos=True: add the special tokens the file's tokenizer.ggml.add_bos/eos_token flags ask for
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=True) == ours


def compare(directory: Path, gguf_file: Path, ids: torch.Tensor, threads: int) -> dict:
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = hf(ids[None]).logits[0].double()
        back = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                    dtype=torch.float32).eval()
        readback = back(ids[None]).logits[0].double()
    del back
    llm = Llama(str(gguf_file), n_ctx=len(ids), n_batch=len(ids), logits_all=True, verbose=False,
                n_threads=threads)
    start = time.perf_counter()
    llm.eval(ids.tolist())
    seconds = time.perf_counter() - start
    theirs = torch.tensor(llm.scores[: len(ids)], dtype=torch.float64)
    log_p, log_q = ours.log_softmax(-1), theirs.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).double().mean()),
            "positions": len(ids),
            "mean_kl_nats": float(kl.mean()), "max_kl_nats": float(kl.max()),
            "llamacpp_rel_logit_error": float((ours - theirs).norm() / ours.norm()),
            "transformers_readback_rel_error": float((ours - readback).norm() / ours.norm()),
            "llamacpp_eval_s": seconds, "gguf_mib": gguf_file.stat().st_size / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/raw/gguf_llamacpp")
    parser.add_argument("--models", nargs="+", choices=GROUPS, default=list(GROUPS),
                        help="model groups (results of groups not run are kept in OUT/results.json)")
    parser.add_argument("--tokens", type=int, default=256, help="prompt length (WikiText-2 test, from the start)")
    parser.add_argument("--types", nargs="+", default=["f32", "f16"],
                        help="add q8_0 where llama.cpp's quantized CPU kernels run (they crash on the 2-core VM)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--depth20", nargs="+", choices=list(DEPTH20), default=list(DEPTH20),
                        help="the shipped models of the depth20 group")
    parser.add_argument("--rows", default=str(ROOT / "benchmarks" / "results" / "gguf_llamacpp.json"),
                        help="committed result file the measured rows are upserted into ('' to skip)")
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install '.[gguf]' (it builds llama.cpp with cmake)")
    from transformers import AutoTokenizer

    from recipe_engine.sources.text import load_text
    from recipe_engine.formats.gguf.writer import export_gguf

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = load_text("wikitext2", "test").text[:20000]
    dirs = build_smollm2(out) if "smollm2" in args.models else {}
    if "tiny" in args.models:
        dirs.update(build_tiny(out, AutoTokenizer.from_pretrained(smollm2_dense(out))))
    if "gemma" in args.models:
        dirs.update(build_gemma(out))
    if "depth20" in args.models:
        dirs.update(build_depth20(out, args.depth20))
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {"models": {}}
    results.update({"prompt": f"WikiText-2 test, first {args.tokens} tokens", "gemma_sleb": GEMMA_SLEB,
                    "llama_cpp_python": llama_cpp.__version__})
    for name, directory in dirs.items():
        tokenizer = AutoTokenizer.from_pretrained(directory)
        ids = torch.tensor(tokenizer(text)["input_ids"][: args.tokens])
        for kind in args.types:
            gguf_file = out / f"{name}-{kind}.gguf"
            export_gguf(directory, gguf_file, kind, force=True, name=gguf_name(name))
            row = compare(directory, gguf_file, ids, args.threads)
            row["tokenizer_agrees"] = tokenizer_agrees(directory, gguf_file, text[:4000])
            if name.startswith("depth20_"):
                row["chosen"] = depth20_choice(directory)
                row["layers"] = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
            results["models"][f"{name} {kind}"] = row
            print(json.dumps({f"{name} {kind}": row}), flush=True)
            results_file.write_text(json.dumps(results, indent=2))
            gguf_file.unlink()
    if args.rows:
        write_rows(Path(args.rows), results, list(dirs), f"llama-cpp-python {llama_cpp.__version__} built from "
                   f"source, {args.threads} threads")
    print(f"{'model':<26} {'top-1':>7} {'mean KL':>10} {'max KL':>10} {'rel err llama.cpp':>18} "
          f"{'rel err transformers':>21} {'MiB':>7} {'tokens':>7}")
    for key, row in results["models"].items():
        print(f"{key:<26} {row['top1_agreement']:>7.4f} {row['mean_kl_nats']:>10.2e} {row['max_kl_nats']:>10.2e} "
              f"{row['llamacpp_rel_logit_error']:>18.2e} {row['transformers_readback_rel_error']:>21.2e} "
              f"{row['gguf_mib']:>7.1f} {str(row.get('tokenizer_agrees', '')):>7}")


if __name__ == "__main__":
    main()
