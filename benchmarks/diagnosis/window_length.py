"""Why BestOf's score can rank alternatives differently from the held-out perplexities: window length.

BestOf scores alternatives on held-out *calibration* windows (512 tokens of the Wikipedia sample); the
held-out protocol measures perplexity on 1024-token windows of other text. This script compresses a model
with a few methods (the held-out protocol's calibration: 32 × 512 Wikipedia-sample tokens, seed 0) and
measures every model on the same tokens cut into windows of 512 and of 1024 tokens (WikiText-2 test, the C4
sample, the code sample: the first ``--tokens`` tokens of each), so a ranking that flips between the two
lengths shows the positions beyond the calibration length at work.

Run: python -m benchmarks.diagnosis.window_length [--model smollm2-135m] [--methods ReplaceMe FlattenGPT ...]
It prints a table and writes benchmarks/results/raw/window_length_<model>.json.
"""
from __future__ import annotations

import datetime
import json
import math

from benchmarks.compare_methods import EVALS, RAW
from benchmarks.diagnosis.common import heldout_model, load_dense, parser
from recipe_engine.evaluation.perplexity import perplexity  # noqa: E402
from recipe_engine.sources.text import load_text  # noqa: E402


def main() -> None:
    parse = parser(__doc__.split("\n")[0], ["ReplaceMe", "FlattenGPT", "ReplaceMe+FlattenGPT"])
    parse.add_argument("--tokens", type=int, default=16 * 1024, help="tokens measured per source")
    args = parse.parse_args()
    dense, tokenizer, n = load_dense(args)
    texts = {e: load_text(name, split).text for e, (name, split) in EVALS.items()}
    rows = []
    for name in ["dense", *args.methods]:
        model = heldout_model(args.model, dense, tokenizer, name, n)
        row = {"method": name, "ppl": {}}
        for source, text in texts.items():
            for length in (512, 1024):
                row["ppl"][f"{source}@{length}"] = perplexity(model, tokenizer, text, seq_len=length,
                                                              limit=args.tokens // length)["ppl"]
        rows.append(row)
        print(name, {k: round(v, 2) for k, v in row["ppl"].items()}, flush=True)
    columns = list(rows[0]["ppl"])
    print("\n| method | " + " | ".join(columns) + " | geo. mean @512 | geo. mean @1024 |")
    print("|---" * (len(columns) + 3) + "|")
    for row in rows:
        geo = {length: math.exp(sum(math.log(row["ppl"][f"{s}@{length}"]) for s in texts) / len(texts))
               for length in (512, 1024)}
        row["geo_mean"] = geo
        print(f"| {row['method']} | " + " | ".join(f"{row['ppl'][c]:.2f}" for c in columns)
              + f" | {geo[512]:.2f} | {geo[1024]:.2f} |")
    RAW.mkdir(parents=True, exist_ok=True)
    out = RAW / f"window_length_{args.model}.json"
    out.write_text(json.dumps({"model": args.model, "n": n, "tokens_per_source": args.tokens,
                               "date": datetime.date.today().isoformat(), "threads": args.threads,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
