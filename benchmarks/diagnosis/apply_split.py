"""Where two recorded GPU runs of the 8B-shaped stream8b recipe spent their `recipe apply` wall, phase by
phase, side by side: the timings log's seconds by step (each step's load, forward, compress and write; the
output's own write) from the runs' result files, and the rest of the wall (imports, loading the model and the
calibration text, before the first layer) as the wall less their sum.

    python -m benchmarks.diagnosis.apply_split [--before FILE:INDEX:ID] [--after FILE:INDEX:ID] [--write]

A run is ``benchmarks/results/FILE``, the index of its raw run (``raw.runs[INDEX]``) and its id in the file's
``runs``. By default the two H200 runs of the same recipe that bracket the packed default: 32 layers at 831c1ce
(250.7 s) and at 0f98141 (315.0 s). Prints the table; ``--write`` stores it in the later run's file (its
``tables``, replacing one with the same title; the earlier run's record added to its ``runs``), for
``benchmarks/report.py`` to render.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
BEFORE, AFTER = "gpu_acceptance_h200.json:1:full", "gpu_acceptance_h200_moe.json:0:h200b"
PHASES = ("load", "forward", "compress", "write")
TITLE = "Where the 0f98141 run's extra minute went: the two H200 runs of the 8B-shaped recipe, phase by phase"


def recorded_run(spec: str) -> tuple[dict, str, str, dict]:
    """``FILE:INDEX:ID``'s stream8b figures, its engine commit (short), its run id and its ``runs`` record."""
    name, index, run_id = spec.split(":")
    stored = json.loads((RESULTS / name).read_text())
    run = stored["raw"]["runs"][int(index)]
    return run["legs"]["stream8b"]["figures"], run["machine"]["git_commit"][:7], run_id, stored["runs"][run_id]


def split(figures: dict) -> dict[str, float]:
    """``{part: seconds}``: each step's phases (``other`` folded into its largest), the output's write, and the
    rest of the wall; the parts sum to ``apply_wall_s``."""
    parts = {}
    for step, seconds in figures["timings"]["seconds_by_step"].items():
        if not step:  # the output's record: written after the last step
            parts["the output written"] = sum(seconds.values())
            continue
        for phase in PHASES:
            parts[f"{step}: {phase}"] = seconds.get(phase, 0.0)
        largest = max(PHASES, key=lambda phase: seconds.get(phase, 0.0))
        parts[f"{step}: {largest}"] += seconds.get("other", 0.0)
    parts["the rest (imports, loading, calibration text)"] = figures["apply_wall_s"] - sum(parts.values())
    parts["the whole `recipe apply`"] = figures["apply_wall_s"]
    return parts


def table(before: str, after: str) -> dict:
    """The side-by-side table (``tables`` schema of benchmarks/results/README.md)."""
    (old, old_commit, old_id, _), (new, new_commit, new_id, _) = recorded_run(before), recorded_run(after)
    old_parts, new_parts = split(old), split(new)
    rows = [{"what": part, "before": f"{old_parts.get(part, 0.0):.1f}", "after": f"{new_parts.get(part, 0.0):.1f}",
             "change": f"{new_parts.get(part, 0.0) - old_parts.get(part, 0.0):+.1f}", "run": [old_id, new_id]}
            for part in dict.fromkeys([*old_parts, *new_parts])]
    return {"title": TITLE,
            "intro": f"`python -m benchmarks.diagnosis.apply_split`: the timings logs' seconds by step of the two "
                     f"recorded 32-layer runs ({old['calibration']} tokens, `FlattenAdjacent<n:7>, HeadPrune, "
                     f"NystromMLP, GPTQ<bits:4,group_size:128>`, streamed), engine {old_commit} (its output "
                     f"dequantized bf16) against {new_commit} (the packed default: compressed-tensors; the "
                     f"engine of the run labelled 0f98141, which adds only an acceptance leg). The rest of the "
                     f"wall is the wall less the logged phases.",
            "columns": [{"key": "what", "label": "part of the run (seconds)"},
                        {"key": "before", "label": f"{old_commit}: bf16 output"},
                        {"key": "after", "label": f"{new_commit}: packed output"},
                        {"key": "change", "label": "change"}],
            "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--after", default=AFTER)
    parser.add_argument("--write", action="store_true", help="store the table in the later run's result file")
    args = parser.parse_args()
    result = table(args.before, args.after)
    print(" | ".join(c["label"] for c in result["columns"]))
    for row in result["rows"]:
        print(" | ".join(str(row[c["key"]]) for c in result["columns"]))
    if args.write:
        path = RESULTS / args.after.partition(":")[0]
        stored = json.loads(path.read_text())
        _, _, before_id, before_run = recorded_run(args.before)
        stored["runs"].setdefault(before_id, before_run)
        tables = [t for t in stored.get("tables", []) if t["title"] != TITLE]
        stored["tables"] = [*tables, {**result, "notes": next((t.get("notes", []) for t in stored.get("tables", [])
                                                               if t["title"] == TITLE), [])}]
        path.write_text(json.dumps(stored, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
