"""Tokenizing a calibration or evaluation text: the same ids as calling the tokenizer, and the host memory it
takes while it runs.

    OMP_NUM_THREADS=2 python -m benchmarks.tokenize_memory [--models smollm2-135m qwen2.5-0.5b gemma3-270m]

For each shipped model's tokenizer and each local text (WikiText-2 validation and test, the Wikipedia, C4 and
code samples' train splits): the ids of ``recipe_engine.sources.windows.tokenize`` (a fast tokenizer's backend,
``encode_batch_fast``: no character offsets) against the tokenizer called as transformers documents it
(``tokenizer(text, add_special_tokens=False)["input_ids"]``), which must be equal; and for each way, its
transient: the process's high-water mark while it runs (``host_memory.PeakWatch``: ``VmHWM``, reset before)
above the resident size before it, with the freed heap given back in between; and its seconds. Printed as
JSON, one row per tokenizer and text.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TEXTS = [("wikitext2", "validation"), ("wikitext2", "test"), ("wikipedia-sample", "train"),
         ("c4-sample", "train"), ("code-sample", "train")]


def transient(call) -> tuple[object, int, float]:
    """``call()``'s result, the bytes the process's high-water mark rose above its resident size before, and
    its seconds."""
    from recipe_engine.system.host_memory import PeakWatch, current_rss, trim_heap

    trim_heap()
    watch = PeakWatch()
    watch.start()
    before, started = current_rss(), time.perf_counter()
    result = call()
    return result, watch.stop() - before, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b", "gemma3-270m"])
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from recipe_engine.sources.text import load_text
    from recipe_engine.sources.windows import tokenize
    from recipe_engine.sources.models import resolve_model

    rows = []
    for model in args.models:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(model).location)
        for name, split in TEXTS:
            text = load_text(name, split).text

            def called():
                ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
                return torch.tensor(ids, dtype=torch.long)

            reference, called_bytes, called_s = transient(called)
            ids, tokenize_bytes, tokenize_s = transient(lambda: tokenize(tokenizer, text))
            rows.append({"model": model, "text": f"{name} {split}", "tokens": ids.numel(),
                         "equal": bool(torch.equal(ids, reference)),
                         "called_mib": round(called_bytes / 2**20, 1),
                         "tokenize_mib": round(tokenize_bytes / 2**20, 1), "called_s": round(called_s, 2),
                         "tokenize_s": round(tokenize_s, 2)})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"rows": rows, "all_equal": all(row["equal"] for row in rows)}, indent=1))


if __name__ == "__main__":
    main()
