"""Timing helpers of ``recipe bench``: interleaved repeats, median and p90, the clock of one ``generate``,
and the GPU's busy share sampled while it decodes."""
from __future__ import annotations

import datetime
import math
import shutil
import subprocess
import threading
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(models: list, measure, warmup: int, repeats: int, warmed: list | None = None) -> list[list]:
    """Samples per model: ``warmup`` untimed runs of each model in turn (their results appended per model to
    ``warmed``, when given), then ``repeats`` rounds of A, B, A, B, ... so drift in the machine's load hits every
    model alike."""
    for model in models:
        runs = [measure(model) for _ in range(warmup)]
        if warmed is not None:
            warmed.append(runs)
    samples: list[list] = [[] for _ in models]
    for _ in range(repeats):
        for i, model in enumerate(models):
            samples[i].append(measure(model))
    return samples


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the two nearest order statistics (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: list[float]) -> dict:
    """Median and p90 (the slow tail of a time) of ``values``."""
    return {"median": percentile(values, 50), "p90": percentile(values, 90)}


class Clock:
    """A ``generate`` streamer that notes when the first new token reaches the host (the prompt's ``put``
    comes first; each later ``put`` has already waited for the device), so one run gives the time to the
    first token and the decode time after it."""

    def __init__(self):
        self.start = time.perf_counter()
        self.puts: list[float] = []

    def put(self, value) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass

    @property
    def first_token(self) -> float | None:
        return self.puts[1] if len(self.puts) > 1 else None


class BusySampler:
    """The GPU's utilisation (the share of time a kernel ran, ``nvidia-smi``'s ``utilization.gpu``) sampled
    every ``interval`` s in a thread, through pynvml where installed, else ``nvidia-smi``'s loop (each sample
    timed by nvidia-smi's own timestamp: its pipe may deliver lines late); ``share`` averages the samples taken
    inside the given windows. No GPU or neither tool: ``source`` is None."""

    def __init__(self, device: torch.device, interval: float = 0.05):
        self.samples: list[tuple[float, float]] = []  # (time.time(), utilisation 0-1)
        self._offset = time.time() - time.perf_counter()  # windows come in perf_counter seconds
        self.source, self._stop, self._thread = None, threading.Event(), None
        if device.type != "cuda":
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            import pynvml  # deferred: optional (nvidia-ml-py), and only on a GPU

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.source = "pynvml"
            self._thread = threading.Thread(target=self._poll, args=(pynvml, handle, interval), daemon=True)
        except Exception:  # noqa: BLE001 - pynvml absent or unusable: nvidia-smi, else not measured
            if shutil.which("nvidia-smi"):
                self.source = "nvidia-smi"
                self._thread = threading.Thread(target=self._follow, args=(index, interval), daemon=True)

    def __enter__(self):
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _poll(self, pynvml, handle, interval: float) -> None:
        while not self._stop.wait(interval):
            self.samples.append((time.time(), pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100))

    def _follow(self, index: int, interval: float) -> None:
        process = subprocess.Popen(["nvidia-smi", "-i", str(index), "--query-gpu=timestamp,utilization.gpu",
                                    "--format=csv,noheader,nounits", "-lms", str(max(1, int(interval * 1000)))],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            for line in process.stdout:
                sample = parse_smi_line(line)
                if sample is not None:
                    self.samples.append(sample)
                if self._stop.is_set():
                    break
        finally:
            process.terminate()
            process.wait()

    def share(self, windows: list[tuple[float, float]]) -> float | None:
        """Mean utilisation (0-1) of the samples inside ``windows`` ((start, end) perf_counter seconds)."""
        shifted = [(a + self._offset, b + self._offset) for a, b in windows]
        inside = [u for t, u in self.samples if any(a <= t <= b for a, b in shifted)]
        return sum(inside) / len(inside) if inside else None


def parse_smi_line(line: str) -> tuple[float, float] | None:
    """(time.time(), utilisation 0-1) of an ``nvidia-smi --query-gpu=timestamp,utilization.gpu`` line (local
    time, ``2026/11/27 10:40:39.123, 97``); None for anything else."""
    parts = [p.strip() for p in line.split(",")]
    try:
        stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return stamp, float(parts[1]) / 100
    except (ValueError, IndexError):
        return None
