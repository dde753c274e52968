"""GGUF export checked by llama.cpp: dense SmolLM2, a FlattenGPT output and a ShortGPT output.

Each model is written as an HF directory (``recipe apply`` for the compressed ones), exported with
``recipe export --format gguf`` (f32 and f16; ``--types q8_0`` where llama.cpp's quantized kernels run),
and read by two programs we did not write: llama.cpp through ``llama-cpp-python`` (its own loader and graph;
the same token ids go in, no tokenizer involved) and transformers (``gguf_file=``). Reported per model and type: top-1 agreement of llama.cpp's next-token
prediction with the HF model's over every position of a WikiText-2 test passage, mean KL(HF ‖ llama.cpp)
in nats, and the relative logit error of the transformers read-back.

Run (repository root, main venv with ``pip install '.[gguf]'``; ~10 CPU minutes, most in FlattenGPT):
    nice -n 10 python benchmarks/gguf_llamacpp.py --out benchmarks/results/gguf_llamacpp
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


def build_models(out: Path) -> dict[str, Path]:
    from recipe_engine import apply
    from recipe_engine.io.models import load_model

    dirs = {"dense_30": out / "dense"}
    if not (dirs["dense_30"] / "config.json").is_file():
        model, tokenizer, _ = load_model("smollm2-135m", "float32")
        model.save_pretrained(dirs["dense_30"])
        tokenizer.save_pretrained(dirs["dense_30"])
    for name, recipe in RECIPES.items():
        dirs[name] = out / name
        if not (dirs[name] / "config.json").is_file():
            apply(str(ROOT / recipe), overrides=["evaluate=null", f"output={dirs[name]}"], force=True,
                  progress=False)
    return dirs


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
            "mean_kl_nats": float(kl.mean()), "max_kl_nats": float(kl.max()),
            "llamacpp_rel_logit_error": float((ours - theirs).norm() / ours.norm()),
            "transformers_readback_rel_error": float((ours - readback).norm() / ours.norm()),
            "llamacpp_eval_s": seconds, "gguf_mib": gguf_file.stat().st_size / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gguf_llamacpp")
    parser.add_argument("--tokens", type=int, default=256, help="prompt length (WikiText-2 test, from the start)")
    parser.add_argument("--types", nargs="+", default=["f32", "f16"],
                        help="add q8_0 where llama.cpp's quantized CPU kernels run (they crash on the 2-core VM)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install '.[gguf]' (it builds llama.cpp with cmake)")
    from recipe_engine.io.data import load_text
    from recipe_engine.io.gguf_export import export_gguf
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dirs = build_models(out)
    tokenizer = AutoTokenizer.from_pretrained(dirs["dense_30"])
    text = load_text("wikitext2", "test").text
    ids = torch.tensor(tokenizer(text[:20000])["input_ids"][: args.tokens])
    results = {"prompt": f"WikiText-2 test, first {len(ids)} tokens", "llama_cpp_python": llama_cpp.__version__,
               "models": {}}
    for name, directory in dirs.items():
        for kind in args.types:
            gguf_file = out / f"{name}-{kind}.gguf"
            export_gguf(directory, gguf_file, kind, force=True, name=name)
            row = compare(directory, gguf_file, ids, args.threads)
            results["models"][f"{name} {kind}"] = row
            print(json.dumps({f"{name} {kind}": row}), flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"{'model':<20} {'top-1':>7} {'mean KL':>10} {'max KL':>10} {'rel err llama.cpp':>18} "
          f"{'rel err transformers':>21} {'MiB':>7}")
    for key, row in results["models"].items():
        print(f"{key:<20} {row['top1_agreement']:>7.4f} {row['mean_kl_nats']:>10.2e} {row['max_kl_nats']:>10.2e} "
              f"{row['llamacpp_rel_logit_error']:>18.2e} {row['transformers_readback_rel_error']:>21.2e} "
              f"{row['gguf_mib']:>7.1f}")


if __name__ == "__main__":
    main()
