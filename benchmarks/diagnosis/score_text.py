"""Does more score text make BestOf's choice transfer to held-out text?

BestOf scores each alternative on the held-out quarter of the calibration windows (8 of 32 × 512 tokens of
the Wikipedia sample). This script builds each alternative's model the way the held-out protocol does
(fitted on all 32 calibration windows, seed 0) and scores it on ``--extra`` further windows of the *same*
calibration source that no alternative saw: the windows that follow the calibration ones in the seeded
permutation ``sample_windows`` draws from, so they are disjoint from them by construction. Per model it
reports the token-weighted NLL on those windows with the paired standard error of its difference to the
best one (windows as the unit), and the mean KL divergence from the dense model's next-token distribution
(``KL(dense || model)``), a score that asks how closely the model follows the original rather than how well
it fits the text. The last column is the held-out protocol's geometric mean over WikiText-2 / C4 / code,
read from the committed rows, so the three rankings can be compared.

Run: python -m benchmarks.diagnosis.score_text [--model smollm2-135m] [--methods ...] [--extra 64]
It prints a table and writes benchmarks/results/raw/score_text_<model>.json.
"""
from __future__ import annotations

import datetime
import json
import math

import torch

from benchmarks.compare_methods import CALIBRATIONS, RAW, RESULTS, ROW_FILES
from benchmarks.diagnosis.common import heldout_model, load_dense, parser
from recipe_engine.sources.text import load_text  # noqa: E402
from recipe_engine.sources.windows import tokenize

ROW_NAMES = {"ReplaceMe": "ReplaceMe", "ReplaceMe+FlattenGPT": "ReplaceMe, then FlattenGPT",
             "FlattenGPT": "FlattenGPT (ours)", "ShortGPT+LinearPatch": "ShortGPT + LinearPatch",
             "SLEB+LinearPatch": "SLEB + LinearPatch", "SLEB": "SLEB", "ShortGPT": "ShortGPT"}


def extra_windows(ids: torch.Tensor, calibration: int, extra: int, seq_len: int, seed: int) -> torch.Tensor:
    """The ``extra`` windows drawn after the ``calibration`` ones by ``sample_windows``' seeded permutation."""
    available = ids.numel() // seq_len
    order = torch.randperm(available, generator=torch.Generator().manual_seed(seed))
    chosen = order[calibration:calibration + extra].sort().values
    return ids[: available * seq_len].view(available, seq_len)[chosen].clone()


@torch.no_grad()
def per_window(model, dense, windows: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per window: summed next-token NLL and summed KL(dense || model) (fp64 sums; the dense model's
    distribution is recomputed per window rather than stored, vocabulary × tokens being large)."""
    nll, kl = [], []
    for window in windows:
        lp = torch.log_softmax(model(window[None]).logits[0, :-1].float(), dim=-1)
        nll.append(-lp.gather(1, window[1:, None]).double().sum().item())
        if model is dense:
            kl.append(0.0)
            continue
        ref = torch.log_softmax(dense(window[None]).logits[0, :-1].float(), dim=-1)
        kl.append((ref.exp() * (ref - lp)).double().sum().item())
    return nll, kl


def committed_geo_means(model: str) -> dict[str, float]:
    rows = json.loads((RESULTS / ROW_FILES[model][0]).read_text())["rows"]
    out = {}
    for row in rows:
        if row["protocol"] == "held-out" and {"wikitext2", "c4", "code"} <= set(row.get("ppl", {})):
            out[row["method"]] = math.exp(sum(math.log(row["ppl"][s]) for s in ("wikitext2", "c4", "code")) / 3)
    return out


def main() -> None:
    parse = parser(__doc__.split("\n")[0], ["ReplaceMe", "ReplaceMe+FlattenGPT", "FlattenGPT", "ShortGPT+LinearPatch"])
    parse.add_argument("--extra", type=int, default=64, help="score windows beyond the calibration ones")
    args = parse.parse_args()
    dense, tokenizer, n = load_dense(args)
    dataset, split = CALIBRATIONS["wikipedia"]
    ids = tokenize(tokenizer, load_text(dataset, split).text)
    windows = extra_windows(ids, 32, args.extra, 512, 0)
    dense_nll, _ = per_window(dense, dense, windows)
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    geo = committed_geo_means(args.model)
    rows = [{"method": "dense", "nll": sum(dense_nll) / tokens, "kl": 0.0, "per_window_nll": dense_nll}]
    for name in args.methods:
        model = heldout_model(args.model, dense, tokenizer, name, n)
        nll, kl = per_window(model, dense, windows)
        rows.append({"method": name, "nll": sum(nll) / tokens, "kl": sum(kl) / tokens, "per_window_nll": nll,
                     "heldout_geo_mean": geo.get(ROW_NAMES.get(name, name))})
        print(name, round(rows[-1]["nll"], 4), round(rows[-1]["kl"], 4), flush=True)
        del model
    best = min(rows[1:], key=lambda r: r["nll"])
    per_tokens = windows.shape[1] - 1
    for row in rows:
        diffs = [(a - b) / per_tokens for a, b in zip(row["per_window_nll"], best["per_window_nll"])]
        mean = sum(diffs) / len(diffs)
        var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
        row["minus_best"], row["minus_best_se"] = mean, math.sqrt(var / len(diffs))
    print(f"\n{args.model}, n = {n}: {args.extra} Wikipedia-sample windows × 512 tokens beyond the 32 calibration ones")
    print("| method | NLL | − best (paired s.e.) | KL(dense ‖ model) | held-out geo. mean PPL |")
    print("|---|---|---|---|---|")
    for row in rows:
        g = row.get("heldout_geo_mean")
        print(f"| {row['method']} | {row['nll']:.4f} | {row['minus_best']:+.4f} ({row['minus_best_se']:.4f}) | "
              f"{row['kl']:.4f} | {'–' if g is None else f'{g:.2f}'} |")
    RAW.mkdir(parents=True, exist_ok=True)
    out = RAW / f"score_text_{args.model}.json"
    out.write_text(json.dumps({"model": args.model, "n": n, "extra_windows": args.extra, "seq_len": 512,
                               "date": datetime.date.today().isoformat(), "threads": args.threads,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
