"""The acceptance's record: the machine it ran on, OUT/gpu_acceptance.json written atomically, the printed table,
and ``--pack``'s one archive of every run's logs."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.acceptance import carry

ROOT = Path(__file__).resolve().parents[2]


def machine(device: str) -> dict:
    import torch
    import transformers

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.acceptance", *sys.argv[1:]]),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "device": device}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        meta.update(device_name=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        meta["device_name"] = platform.processor() or platform.machine()
    try:
        meta["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                            cwd=ROOT).stdout.strip() or None
    except OSError:
        meta["git_commit"] = None
    return meta


def write_result(out: Path, result: dict) -> None:
    tmp = out / (carry.RESULT + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, out / carry.RESULT)


def table(result: dict) -> str:
    lines = [f"GPU acceptance on {result['machine'].get('device_name')} ({result['machine']['device']}), "
             f"{result['machine']['date']}, torch {result['machine']['torch']}"]
    for leg, record in result["legs"].items():
        if record["status"] != "ok":
            lines.append(f"  {leg}: {record['status']}: {record.get('error', '')}")
    lines.append(f"  {'leg':<9} {'figure':<72} {'value':>14} {'goal':<36} met")
    for r in result["rows"]:
        value = r["value"] if not isinstance(r["value"], float) else f"{r['value']:.4g}"
        met = {True: "met", False: "NOT MET", None: "-"}[r["met"]]
        lines.append(f"  {r['leg']:<9} {r['figure'][:72]:<72} {str(value)[:14]:>14} {r['goal'][:36]:<36} {met}")
    return "\n".join(lines)


def pack_runs(out: Path, work: Path) -> None:
    """``--pack``: the runs' timings logs and GPU traces move from OUT into ``WORK/runs/``, and those with every
    run's log and recipe go into one ``OUT/runs.tar.gz`` (rewritten after each leg). What a lent machine sends
    back is then a few files (gpu_acceptance.json, runs.tar.gz, the detached log), under its file count."""
    import tarfile

    kept = work / "runs"
    kept.mkdir(parents=True, exist_ok=True)
    for path in [*out.glob("timings-*.jsonl"), *out.glob("gpu-*.csv"), *out.glob("host-*.*")]:
        shutil.move(path, kept / path.name)
    partial = out / "runs.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as archive:
        archive.add(kept, arcname="runs")
        for path in sorted([*work.rglob("*.log"), *work.rglob("*.yaml"), *work.rglob("top_operations.txt"),
                           *work.rglob("gaps.txt")]):
            if kept not in path.parents:
                archive.add(path, arcname=f"logs/{path.relative_to(work)}")
    os.replace(partial, out / "runs.tar.gz")
