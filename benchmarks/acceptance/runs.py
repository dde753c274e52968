"""Each engine run of the GPU acceptance in its own logged process under the shared budget: ``recipe apply``
with its timings log, its peak RSS watched and the GPU's utilisation traced, and the row a leg records per
figure."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Goals every leg that runs a recipe on the GPU shares: the GPU busy over the run, peak GPU over the plan.
GOAL_GPU_BUSY = 0.60
GOAL_GPU_OVER_ESTIMATE = 1.5
#: Where the result, the logs, the timings logs and the GPU trace go (``--out``); set by the driver's ``run``
OUT = Path(".")
#: py-spy's executable (``--sample-host``): every ``recipe apply`` run is sampled by it; None: not sampled
HOST_SAMPLER: str | None = None


class LegError(Exception):
    """A leg's one-line failure."""


#: The repository root whose ``recipe_engine`` every run uses (``--engine``; this one by default): an older
#: engine's package beside this harness, for an A/B on one lent machine.
ENGINE = ROOT


def engine_env() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ENGINE), os.environ.get("PYTHONPATH")) if p)}
    return {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                       "MASTER_PORT")}


#: time.monotonic() by which every run must have ended (``--budget``); set by the driver's ``run``
DEADLINE = float("inf")


def run_logged(command: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[float, float | None]:
    """Run ``command`` (output to ``log``), watching its peak RSS; returns (wall seconds, peak MiB).
    A non-zero exit or the timeout (the smaller of ``timeout`` and what is left of ``--budget``):
    :class:`LegError` with the log's last line."""
    from benchmarks import scale

    timeout = min(timeout, DEADLINE - time.monotonic())
    if timeout <= 0:
        raise LegError("no time left of --budget")
    with log.open("w") as out:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ENGINE,  # -m finds it first
                                   env=env or engine_env())
        peak: dict = {}
        stop = threading.Event()
        threading.Thread(target=scale._watch_rss, args=(process.pid, peak, stop), daemon=True).start()
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise LegError(f"{' '.join(command[:4])} ... ran past {timeout:.0f} s; see {log}") from None
        finally:
            stop.set()
    if code != 0:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise LegError(f"exit {code}: {lines[-1] if lines else '(no output)'} (log {log})")
    return time.perf_counter() - start, peak.get("hwm_mib")


def gpu_trace(path: Path):
    """``nvidia-smi`` sampling utilisation, power and memory every 0.5 s into ``path`` (None without it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    handle = path.open("w")
    process = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,power.draw,memory.used",
                                "--format=csv,noheader,nounits", "-lms", "500"], stdout=handle,
                               stderr=subprocess.DEVNULL)
    return process, handle, path


def stop_trace(sampler) -> float | None:
    """Stop a :func:`gpu_trace`; the mean utilisation (0–1) of its samples."""
    if sampler is None:
        return None
    process, handle, path = sampler
    process.terminate()
    process.wait()
    handle.close()
    busy = [utilisation for _, utilisation in trace_samples(path)]
    return round(sum(busy) / len(busy), 3) if busy else None


def trace_samples(path: Path) -> list[tuple[float, float]]:
    """A :func:`gpu_trace`'s samples as ``(unix seconds, utilisation 0–1)`` (``nvidia-smi`` stamps local time)."""
    from datetime import datetime

    samples = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[1].replace(".", "", 1).isdigit():
            try:
                stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            except ValueError:
                continue
            samples.append((stamp, float(parts[1]) / 100))
    return samples


def busy_between(path: Path | None, start: float, end: float) -> tuple[float | None, float]:
    """The mean utilisation of a trace's samples between the unix times ``start`` and ``end``, and the busy
    seconds in that window (the mean times its length); ``(None, 0.0)`` without samples there."""
    if path is None or not path.is_file():
        return None, 0.0
    inside = [busy for stamp, busy in trace_samples(path) if start <= stamp <= end]
    if not inside:
        return None, 0.0
    mean = sum(inside) / len(inside)
    return round(mean, 3), mean * (end - start)


def disk_write_speed(directory: Path, mib: int = 256) -> float:
    """MB/s of writing ``mib`` MiB to ``directory`` and syncing it (the machine's disk write-back speed)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".write-speed"
    block = os.urandom(2**20)
    started = time.perf_counter()
    with path.open("wb") as handle:
        for _ in range(mib):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return round(mib * 2**20 / seconds / 1e6, 1)


def row(leg: str, figure: str, value, unit: str, goal: str, met: bool | None, **extra) -> dict:
    return {"leg": leg, "figure": figure, "value": value, "unit": unit, "goal": goal, "met": met, **extra}



def apply_recipe(recipe: dict, work: Path, timeout: float, launcher: list[str] | None = None,
                 trace: bool = False, profile: bool = False) -> dict:
    """``recipe apply`` of ``recipe`` in a subprocess (``launcher``: e.g. torchrun's arguments before
    ``-m``); returns its report, wall time, watched peak RSS, log path and its timings log
    (``OUT/timings-NAME.jsonl``, kept). ``trace``: sample the GPU's utilisation while it runs
    (``OUT/gpu-NAME.csv``; ``gpu_busy`` in the result). A run that fails or is stopped raises
    :class:`LegError` with its timings so far (seconds by phase per step) in ``partial``. ``profile``:
    ``recipe apply --profile WORK/profile-NAME`` (a few layers under torch.profiler; their timings are slower;
    ``top_operations.txt`` and ``gaps.txt``, the GPU's idle gaps by phase and host operation from
    ``benchmarks/diagnosis/gpu_gaps.py``, go into runs.tar.gz)."""
    import yaml

    import recipe_engine

    path = work / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    log = work / f"{recipe['name']}.log"
    timings = OUT / f"timings-{recipe['name']}.jsonl"
    command = [*(launcher or [sys.executable]), "-m", "recipe_engine.cli", "apply", str(path), "--force",
               "--quiet", "--no-checkpoints", "--timings", str(timings)]
    if profile:
        command += ["--profile", str(work / f"profile-{recipe['name']}")]
    samples = OUT / f"host-{recipe['name']}.txt"
    if HOST_SAMPLER is not None:  # wall time by thread and frame (--idle), for host_samples.py
        command = [HOST_SAMPLER, "record", "-r", "50", "--idle", "--threads", "--format", "raw", "-o",
                   str(samples.with_suffix(".raw")), "--", *command]
    env = engine_env()
    if launcher:
        env["NCCL_DEBUG"] = "INFO"
    sampler = gpu_trace(OUT / f"gpu-{recipe['name']}.csv") if trace else None
    try:
        wall, peak = run_logged(command, log, timeout, env)
    except LegError as error:
        error.partial = timing_summary(timings)
        raise
    finally:
        busy = stop_trace(sampler)
    if HOST_SAMPLER is not None and samples.with_suffix(".raw").is_file():
        from benchmarks.diagnosis.host_samples import breakdown, read_samples

        samples.write_text(breakdown(read_samples(samples.with_suffix(".raw")), 50,
                                     ["cmd_apply", "write_checkpoint", "run_layer"], 40))
    if profile and (work / f"profile-{recipe['name']}" / "trace.json").is_file():
        from benchmarks.diagnosis.gpu_gaps import format_summary, gap_summary

        profiled = work / f"profile-{recipe['name']}"
        trace = json.loads((profiled / "trace.json").read_text())
        (profiled / "gaps.txt").write_text(format_summary(gap_summary(trace)))
    return {"report": recipe_engine.load_report(recipe["output"]), "wall_s": wall, "watched_peak_mib": peak,
            "log": log, "timings": timing_summary(timings), "gpu_busy": busy, "timings_path": timings,
            "trace_path": sampler[2] if sampler else None}


def timing_summary(path: Path) -> dict:
    """Seconds by phase per step from a run's timings log, and the layers it finished per pass."""
    from recipe_engine.execution.timings import read_timings, summarize

    if not path.is_file():
        return {}
    records = read_timings(path)
    layers: dict[str, int] = {}
    for record in records:
        if "layer" in record:
            key = f"{record['step']}: {record['pass']}"
            layers[key] = layers.get(key, 0) + 1
    return {"seconds_by_step": {step: {k: round(v, 2) for k, v in phases.items()}
                                for step, phases in summarize(records).items()},
            "layers_done": layers, "records": len(records), "log": str(path)}
