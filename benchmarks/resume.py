"""Resume after SIGKILL: an uninterrupted run, the same run killed at ~60 % of its wall time, then ``--resume``.

    nice -n 10 python -m benchmarks.resume [--kill-at 0.6] [--samples 16] [--seq-len 256] [--streamed]

Recipe ``recipes/flatten20_smollm2.yaml`` (SmolLM2-135M FlattenGPT) on WikiText-2 validation windows, the
recipe's own evaluation switched off, one torch thread per process (``OMP_NUM_THREADS=1``). Reports the
sha256 of both ``model.safetensors`` (goal: identical), the resumed run's wall time over the uninterrupted
one's (goal <= 0.5), where the kill landed (the checkpoint the resume started from) and the size of the
checkpoint directory at the kill. ``--streamed``: both runs streamed (``stream: on``: the model a meta
skeleton, changed units staged in the checkpoint directory, which is then the checkpoint); the JSON also
holds the peak RSS of each run. Prints a table, writes the raw record to
``benchmarks/results/raw/resume.json`` (or ``resume_streamed.json``) and the mode's row of the committed
``benchmarks/results/resume.json`` (``python benchmarks/report.py`` renders it into BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "flatten20_smollm2.yaml"


def load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-at", type=float, default=0.6)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--streamed", action="store_true", help="stream: on (the model streamed from disk)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def command(output: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "recipe_engine.cli", "apply", str(RECIPE), "--output", str(base / output),
                "--set", "calibration.dataset=wikitext2", "--set", "calibration.split=validation",
                "--set", f"calibration.samples={args.samples}", "--set", f"calibration.seq_len={args.seq_len}",
                "--set", "evaluate=null", *(("--set", "stream='on'") if args.streamed else ()), "--quiet", *extra]

    load_before = load()
    start = time.perf_counter()
    subprocess.run(command("full"), env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    full = time.perf_counter() - start

    killed = subprocess.Popen(command("resumed"), env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        killed.wait(timeout=args.kill_at * full)
        raise SystemExit(f"the run finished before {args.kill_at:.0%} of the full run's time: nothing to resume")
    except subprocess.TimeoutExpired:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    checkpoints = base / ".resumed.resume"
    manifest = json.loads((checkpoints / "manifest.json").read_text())
    stored = sum(p.stat().st_size for p in checkpoints.iterdir())
    start = time.perf_counter()
    subprocess.run(command("resumed", "--resume"), env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    resumed = time.perf_counter() - start
    load_after = load()

    full_sha, resumed_sha = sha256(base / "full" / "model.safetensors"), sha256(base / "resumed" / "model.safetensors")
    record = {"recipe": str(RECIPE.relative_to(ROOT)),
              "calibration": f"{args.samples}x{args.seq_len} wikitext2 validation",
              "full_s": full, "killed_after_s": args.kill_at * full, "resumed_s": resumed,
              "resumed_ratio": resumed / full, "killed_at": manifest["reached"], "checkpoint_bytes": stored,
              "sha256": {"full": full_sha, "resumed": resumed_sha}, "identical": full_sha == resumed_sha,
              "load_average": {"before": load_before, "after": load_after}, "streamed": args.streamed,
              "peak_rss_mib": {run: json.loads((base / run / "report.json").read_text())["peak_memory"]
                               for run in ("full", "resumed")}}
    print(f"{'run':<34}{'wall s':>9}")
    print(f"{'uninterrupted':<34}{full:>9.1f}")
    print(f"{f'killed (SIGKILL) at {args.kill_at:.0%}':<34}{args.kill_at * full:>9.1f}")
    print(f"{'--resume':<34}{resumed:>9.1f}")
    print(f"resumed / full {record['resumed_ratio']:.3f} (goal <= 0.5); killed at {manifest['reached']}; "
          f"checkpoints {stored / 2**20:.0f} MiB; sha256 identical: {record['identical']}; "
          f"load {load_before} -> {load_after}")
    out = ROOT / "benchmarks" / "results" / "raw" / ("resume_streamed.json" if args.streamed else "resume.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    written = json.loads((base / "full" / "report.json").read_text()).get("checkpoints") or {}
    write_row(record, args.kill_at, written)


def write_row(record: dict, kill_at: float, written: dict) -> None:
    """This mode's row of the committed table (benchmarks/results/resume.json), this run as its run."""
    from benchmarks import rowstore

    load = record["load_average"]
    run = rowstore.run_record(f"load average {load['before'][0]} before, {load['after'][0]} after; one sample")
    rss = record["peak_rss_mib"]
    row = {"mode": "streamed" if record["streamed"] else "in memory", "full": f"{record['full_s']:.1f}",
           "killed": f"{record['killed_after_s']:.1f} ({kill_at:.2f})",
           "resumed": f"**{record['resumed_s']:.1f}** (**{record['resumed_ratio']:.2f}**; after layer "
                      f"{record['killed_at'].get('layer')})",
           "checkpoints": f"{written.get('written', '–')}, {written.get('seconds', 0):.1f} s, "
                          f"{written.get('bytes', 0) / 1e6:.0f} MB",
           "at_kill": f"{record['checkpoint_bytes'] / 2**20:.0f} MiB",
           "rss": f"{rss['full']['rss_mib']:.0f} / {rss['resumed']['rss_mib']:.0f} MiB",
           "sha": f"`{record['sha256']['full'][:8]}…` {'yes' if record['identical'] else 'no'}"}
    columns = [{"key": k, "label": k} for k in row]   # used only if the table is missing
    rowstore.upsert_table_row(ROOT / "benchmarks" / "results" / "resume.json",
                              "Resume after SIGKILL at 60 % of an uninterrupted run", row, run, "mode",
                              section="Scale", order=62, columns=columns)


if __name__ == "__main__":
    main()
