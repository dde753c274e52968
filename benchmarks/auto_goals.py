"""The auto recipe (``recipes/depth20_auto.yaml``) against the best single depth method, per model and budget.

Reads the committed held-out rows (``benchmarks/results/quality_<model>.json``: the main budget's ``rows`` and
the ``sweep`` rows at other n) and, for every model and n with an auto row, compares it with the single
methods the recipe must never lose to: ShortGPT, SLEB, ShortGPT + LinearPatch, SLEB + LinearPatch, ReplaceMe
(its hook form where the architecture refuses the fold) and FlattenGPT (the shipped defaults).

- geometric mean of the held-out PPLs over WikiText-2, C4 and code: auto / the best single method's
  ("never worse": ≤ 1; "better": ≤ 0.8);
- per source: auto / the best single method on that source (never worse: ≤ 1.10);
- zero-shot (5 tasks × 200 rows), where both are measured: auto ≥ the best single method's − one standard
  error (0.015 at 200 rows per task).

A method measured only on other evaluation windows is "not measured" here. Where the auto recipe's rows on
some windows equal one single method's on every source (the recipe chose that method, and its refit is that
method run alone), that identity is stated and the method's rows stand for the auto recipe's on the windows it
was not run on.

Run: python -m benchmarks.auto_goals   (prints the table, upserts it into benchmarks/results/auto_goals.json;
     python benchmarks/report.py then renders it into BENCHMARKS.md)
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.rowstore import load_file, run_record, save

RESULTS = Path(__file__).resolve().parent / "results"
MODEL_FILES = {"SmolLM2-135M": "quality_smollm2.json", "Qwen2.5-0.5B": "quality_qwen2_5_0_5b.json",
               "Gemma-3-270M": "quality_gemma3_270m.json"}
PROTOCOL = "held-out"
SOURCES = ("wikitext2", "c4", "code")
AUTO = "auto (`depth20_auto`)"
#: the single methods, each with the row names that stand for it (first measured one wins)
SINGLES = {"ShortGPT": ["ShortGPT"], "SLEB": ["SLEB"], "ShortGPT + LinearPatch": ["ShortGPT + LinearPatch"],
           "SLEB + LinearPatch": ["SLEB + LinearPatch"],
           "ReplaceMe": ["ReplaceMe", "ReplaceMe, map as a hook (`fold: hook`)"],
           "FlattenGPT": ["FlattenGPT (ours)"]}
ZERO_SHOT_SE = 0.015
OUT = RESULTS / "auto_goals.json"
TITLE = "The auto recipe against the best single method"


def geomean(ppl: dict) -> float:
    return math.exp(sum(math.log(ppl[s]) for s in SOURCES) / len(SOURCES))


def measured(row: dict | None) -> bool:
    return row is not None and "status" not in row and all(s in row.get("ppl", {}) for s in SOURCES)


def rows_by_n(data: dict) -> dict[int, dict[str, dict]]:
    """n → {method: row} over the held-out protocol: the main rows' n from their layer count (a row refused at
    validation, which has none, belongs to the main budget), the sweep rows' from their ``n``."""
    here = [r for r in data["rows"] if r["protocol"] == PROTOCOL]
    dense = next(r for r in here if r["method"] == "dense")
    counts = [dense["layers"] - r["layers"] for r in here if "layers" in r and r["method"] != "dense"]
    main_n = max(set(counts), key=counts.count)
    out: dict[int, dict[str, dict]] = {}
    for row in here:
        if row["method"] != "dense":
            out.setdefault(dense["layers"] - row["layers"] if "layers" in row else main_n, {})[row["method"]] = row
    for row in data.get("sweep", []):
        if row["protocol"] == PROTOCOL and row["n"]:
            out.setdefault(row["n"], {})[row["method"]] = row
    return out


def same_model(data: dict, n: int) -> str | None:
    """The single method whose rows equal the auto recipe's on every source in some protocol at this n."""
    rows = data["rows"] if not any(r.get("n") == n for r in data.get("sweep", [])) else data["sweep"]
    for protocol in {r["protocol"] for r in rows}:
        here = {r["method"]: r for r in rows if r["protocol"] == protocol and r.get("n", n) == n}
        auto = here.get(AUTO)
        if not measured(auto):
            continue
        for names in SINGLES.values():
            for name in names:
                if measured(here.get(name)) and here[name]["ppl"] == auto["ppl"]:
                    return name
    return None


def compare(model: str, data: dict) -> list[dict]:
    out = []
    for n, methods in sorted(rows_by_n(data).items()):
        auto, alias = methods.get(AUTO), same_model(data, n)
        if not measured(auto):
            if alias is None or not measured(methods.get(alias)):
                continue
            auto = methods[alias]
        else:  # measured here; zero-shot may have been measured on the identical single method's model
            auto = {**auto, "zero_shot": auto.get("zero_shot") or methods.get(alias, {}).get("zero_shot")}
            alias = None
        singles, missing = {}, []
        for single, names in SINGLES.items():
            row = next((methods[m] for m in names if measured(methods.get(m))), None)
            refused = any(methods.get(m, {}).get("status") for m in names)
            if row is not None:
                singles[single] = row
            elif not refused:
                missing.append(single)
        if not singles:
            continue
        best = min(singles, key=lambda s: geomean(singles[s]["ppl"]))
        ratio = geomean(auto["ppl"]) / geomean(singles[best]["ppl"])
        per_source = {}
        for source in SOURCES:
            winner = min(singles, key=lambda s: singles[s]["ppl"][source])
            per_source[source] = (auto["ppl"][source] / singles[winner]["ppl"][source], winner)
        zero = None
        if auto.get("zero_shot") and singles[best].get("zero_shot"):
            zero = (auto["zero_shot"]["average"], singles[best]["zero_shot"]["average"])
        never_worse = ratio <= 1 + 1e-9 and all(r <= 1.10 for r, _ in per_source.values()) and \
            (zero is None or zero[0] >= zero[1] - ZERO_SHOT_SE)
        out.append({"model": model, "n": n, "layers": auto["layers"], "auto": geomean(auto["ppl"]),
                    "alias": alias, "best": best, "best_geomean": geomean(singles[best]["ppl"]), "ratio": ratio,
                    "per_source": per_source, "zero_shot": zero, "never_worse": never_worse,
                    "better": ratio <= 0.8, "missing": missing})
    return out


def cells(result: dict) -> dict:
    per = " / ".join(f"{r:.2f} ({w})" for r, w in result["per_source"].values())
    zero = "–" if result["zero_shot"] is None else f"{result['zero_shot'][0]:.3f} vs {result['zero_shot'][1]:.3f}"
    auto = f"{result['auto']:.2f}" + (f" (= {result['alias']})" if result["alias"] else "")
    return {"model": result["model"], "n": str(result["n"]),
            "auto": auto, "best": f"{result['best']} {result['best_geomean']:.2f}", "ratio": f"{result['ratio']:.3f}",
            "per_source": per, "zero_shot": zero, "never_worse": "yes" if result["never_worse"] else "**no**",
            "better": "yes" if result["better"] else "no",
            "missing": ", ".join(result["missing"]) or "–"}


COLUMNS = [{"key": "model", "label": "model"}, {"key": "n", "label": "n"},
           {"key": "auto", "label": "auto geomean PPL"}, {"key": "best", "label": "best single method, geomean"},
           {"key": "ratio", "label": "auto / best"},
           {"key": "per_source", "label": "per source: auto / the best there (WikiText-2 / C4 / code)"},
           {"key": "zero_shot", "label": "zero-shot auto vs best"}, {"key": "never_worse", "label": "never worse"},
           {"key": "better", "label": "≤ 0.8×"}, {"key": "missing", "label": "singles not measured"}]
INTRO = ("Held-out protocol (calibration on the Wikipedia sample; PPL on WikiText-2 test, the C4 sample and the "
         "code sample), each model's own evaluation windows. Geometric mean of the three PPLs; \"never worse\": "
         "auto / best ≤ 1, every source ≤ 1.10× the best method there, zero-shot (where both are measured) ≥ the "
         "best's − 0.015. Single methods: ShortGPT, SLEB, ShortGPT + LinearPatch, SLEB + LinearPatch, ReplaceMe "
         "(its hook form on Gemma 3), FlattenGPT (shipped defaults; refused on Gemma 3). \"(= M)\": the auto "
         "recipe's rows equal M's on other windows (it chose M, and its refit is M run alone), so M's rows stand "
         "for it here. Computed by `benchmarks/auto_goals.py` from the model tables' rows.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    results = []
    for model, name in MODEL_FILES.items():
        results += compare(model, json.loads((RESULTS / name).read_text()))
    rows = [cells(r) for r in results]
    header = [c["label"] for c in COLUMNS]
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(row[c["key"]] for c in COLUMNS))
    data = load_file(args.out, "Choosing the method by measurement", 35)
    run = run_record()
    data["runs"] = {"goals": run}
    data["tables"] = [{"title": TITLE, "intro": INTRO, "columns": COLUMNS,
                       "rows": [{**row, "run": "goals"} for row in rows]}]
    save(args.out, data)
    (RESULTS / "raw").mkdir(exist_ok=True)
    (RESULTS / "raw" / "auto_goals.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
