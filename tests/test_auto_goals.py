"""benchmarks/auto_goals.py: the auto recipe's goals computed from result rows, checked by hand-computed means."""
from __future__ import annotations

import statistics

from benchmarks import auto_goals


def row(method: str, layers: int, wt: float, c4: float, code: float, protocol: str = "held-out", **extra) -> dict:
    return {"protocol": protocol, "method": method, "layers": layers, "ppl": {"wikitext2": wt, "c4": c4, "code": code},
            **extra}


def model_file() -> dict:
    return {"rows": [
        row("dense", 10, 10, 20, 5),
        row("ShortGPT", 8, 40, 60, 9),
        row("SLEB", 8, 30, 70, 8),
        row("ShortGPT + LinearPatch", 8, 35, 50, 12),
        row("SLEB + LinearPatch", 8, 33, 66, 7.5),
        row("ReplaceMe", 8, 28, 55, 10, zero_shot={"average": 0.40}),
        {"protocol": "held-out", "method": "FlattenGPT (ours)", "status": "refused at validation"},
        row("auto (`depth20_auto`)", 8, 29, 52, 8.0, zero_shot={"average": 0.39}),
    ], "sweep": [
        {**row("SLEB", 6, 80, 90, 20), "n": 4}, {**row("ReplaceMe", 6, 70, 100, 30), "n": 4},
        {**row("auto (`depth20_auto`)", 6, 70, 100, 30, protocol="held-out, 24 windows"), "n": 4},
        {**row("ReplaceMe", 6, 70, 100, 30, protocol="held-out, 24 windows"), "n": 4},
    ]}


def test_ratios_and_verdicts_match_a_hand_computation():
    data = model_file()
    results = {r["n"]: r for r in auto_goals.compare("toy", data)}
    main = results[2]
    singles = {r["method"]: r["ppl"] for r in data["rows"] if r["method"] not in ("dense", "auto (`depth20_auto`)")
               and "ppl" in r}
    means = {m: statistics.geometric_mean(p.values()) for m, p in singles.items()}
    best = min(means, key=means.get)
    assert main["best"] == best == "ReplaceMe"
    auto_mean = statistics.geometric_mean([29, 52, 8.0])
    assert abs(main["ratio"] - auto_mean / means[best]) < 1e-12
    assert abs(main["per_source"]["code"][0] - 8.0 / 7.5) < 1e-12
    assert main["per_source"]["code"][1] == "SLEB + LinearPatch"
    assert main["zero_shot"] == (0.39, 0.40)          # 0.39 ≥ 0.40 − 0.015: within one standard error
    assert main["missing"] == []                      # FlattenGPT refused, not missing
    assert main["never_worse"] == (auto_mean <= means[best] and 8.0 / 7.5 <= 1.10)


def test_a_source_over_ten_percent_worse_breaks_never_worse():
    data = model_file()
    data["rows"][-1] = row("auto (`depth20_auto`)", 8, 20, 40, 8.3)   # far better on the mean, code 1.107×
    main = {r["n"]: r for r in auto_goals.compare("toy", data)}[2]
    assert main["ratio"] < 0.8 and main["better"]
    assert not main["never_worse"]


def test_identical_rows_on_other_windows_stand_for_the_auto_recipe():
    results = {r["n"]: r for r in auto_goals.compare("toy", model_file())}
    swept = results[4]
    assert swept["alias"] == "ReplaceMe" and swept["best"] == "SLEB"
    assert abs(swept["ratio"]
               - statistics.geometric_mean([70, 100, 30]) / statistics.geometric_mean([80, 90, 20])) < 1e-12
    assert set(swept["missing"]) == {"ShortGPT", "ShortGPT + LinearPatch", "SLEB + LinearPatch", "FlattenGPT"}
