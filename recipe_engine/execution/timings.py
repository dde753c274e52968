"""Where a run's time goes: seconds by phase for every layer of every pass, one JSON line each.

``recipe apply`` appends the records to ``<output>.timings.jsonl`` beside the output while it runs (flushed
line by line, so a run killed at any point leaves the layers it finished) and keeps a copy in the finished
output. A record::

    {"step": "1-3 HeadPrune, NystromMLP, GPTQ", "pass": "layer-sequential pass", "layer": 3, "layers": 24,
     "seconds": {"load": 0.41, "forward": 1.92, "compress": 0.87, "write": 0.05, "other": 0.01},
     "by_step": {"shared": {"load": 0.41, "forward": 0.3, ...}, "HeadPrune": {"forward": 0.5, ...}, ...},
     "bytes_to_device": 201326592, "bytes_to_host": 0, "peak_device_mib": 5321.4, "host_rss_mib": 6120.3,
     "host_high_water_mib": 7310.9, "at_s": 12.8, "unix_s": 1795824000.125}

``host_rss_mib``: the process's resident memory at the record; ``host_high_water_mib``: its peak since the
running step started (Linux's ``VmHWM``, which the report's per-step peaks reset at each step): the first
record that reaches a step's peak says which layer or phase set it.

``at_s``: seconds since the run's clock started; ``unix_s``: the wall clock at the record (to line the log up
with an outside monitor's samples, e.g. ``nvidia-smi``'s utilisation).

``bytes_to_device``/``bytes_to_host``: the calibration activations that crossed between host and device
(``recipe_engine.execution.activations``: hidden states, the layers' keyword arguments, token windows).

A pass shared by several layer-scope steps splits each layer's phases by step (``by_step``; ``shared``:
loading, the forward that hands the layer's outputs on, writing). A step's last record has
``"event": "step"`` and its wall time.

Phases are exclusive (a stack: a forward inside a step's compression counts as ``forward``, not as
``compress``): ``load`` weights materialized or moved onto the device, ``forward`` layer runs over the
calibration batches (statistics hooks included), ``compress`` a step's own work on the layer (solves,
selection), ``write`` changed weights staged to disk or moved back, ``other`` the rest (Python between
phases). On a GPU every phase boundary synchronizes the device, so each phase's kernels count in it
(a few synchronisations per layer, none per batch); off a GPU no synchronisation is needed.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import torch

from ..paths.targets import is_timings_log, open_fresh, replace_text
from ..system.cleanup import write_marker
from ..system.host_memory import current_rss, high_water_bytes


class Timings:
    """The phase clock of one run (shared by its sessions: the reference model's layers count too).
    ``path=None``: phases are not timed and nothing is written (library calls, branches' own use). The log
    is a new file renamed over ``path`` at the first record; with ``append`` (a resumed run) a timings log
    already there goes on."""

    def __init__(self, path: Path | None = None, device: torch.device = torch.device("cpu"), append: bool = False):
        self.path, self.device, self.append = path, device, append
        self.enabled = path is not None
        self._sync = self.enabled and device.type == "cuda"
        self._file = None
        self._stack: list[str] = []
        self._seconds: dict[str, float] = defaultdict(float)
        self._parts: dict[str, dict[str, float]] = {}
        #: The running step's label (``begin_step``; records name it).
        self.step = ""
        self._started = self._mark = time.perf_counter()
        self.bytes_to_device = self.bytes_to_host = 0
        #: The largest per-record device peak so far (each record resets torch's peak counter to time its
        #: own interval, so the run's peak is kept here; ``peak_device_bytes``).
        self._device_peak = 0
        #: A ``torch.profiler.profile`` stepped once per record (``profiled``), or None.
        self.profiler = None

    def peak_device_bytes(self) -> int:
        """The run's peak allocated device memory, across the records' resets of torch's counter."""
        if self.device.type != "cuda" or not torch.cuda.is_initialized():
            return self._device_peak
        return max(self._device_peak, torch.cuda.max_memory_allocated(self.device))

    # -- the clock ---------------------------------------------------------------------------
    def _switch(self) -> None:
        """Charge the time since the last switch to the phase on top of the stack."""
        if self._sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self._seconds[self._stack[-1] if self._stack else "other"] += now - self._mark
        self._mark = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the block's time to ``name`` (nested phases take their own time out of it)."""
        if not self.enabled:
            yield
            return
        self._switch()
        self._stack.append(name)
        # under --profile the trace marks the phase (benchmarks/diagnosis/gpu_gaps.py charges the GPU's idle gaps to it)
        mark = contextlib.nullcontext() if self.profiler is None else torch.profiler.record_function(f"phase:{name}")
        try:
            with mark:
                yield
        finally:
            self._switch()
            self._stack.pop()

    def moved(self, tensor: torch.Tensor, target: torch.device) -> None:
        """Count ``tensor``'s bytes if moving it to ``target`` crosses between host and device."""
        if self.enabled and (tensor.device.type == "cpu") != (target.type == "cpu"):
            size = tensor.numel() * tensor.element_size()
            if target.type == "cpu":
                self.bytes_to_host += size
            else:
                self.bytes_to_device += size

    # -- records ---------------------------------------------------------------------------
    def begin_step(self, label: str) -> str:
        """Name the records from now on after step ``label`` (a step inside another, such as a BestOf
        alternative, is named under it); returns the outer label for ``end_step``."""
        outer = self.step
        self.step = f"{outer} / {label}" if outer else label
        return outer

    def end_step(self, outer: str) -> None:
        self.step = outer

    def split(self, label: str) -> None:
        """Put the phases since the last split or record under ``label`` in the next record's ``by_step``."""
        if not self.enabled:
            return
        self._switch()
        part = self._parts.setdefault(label, defaultdict(float))
        for phase, seconds in self._seconds.items():
            part[phase] += seconds
        self._seconds.clear()

    def record(self, **fields: Any) -> None:
        """Append one line: the running step, ``fields`` (pass, layer, ...) and the phases since the last
        record (split by step when ``split`` was called; the rest under ``shared``)."""
        if not self.enabled:
            return
        if self._parts:
            self.split("shared")
        else:
            self._switch()
        parts = {label: {k: round(v, 4) for k, v in part.items() if v > 0} for label, part in self._parts.items()}
        totals: dict[str, float] = defaultdict(float)
        for part in list(self._parts.values()) or [self._seconds]:
            for phase, seconds in part.items():
                totals[phase] += seconds
        line = {"step": self.step, **fields, "seconds": {k: round(v, 4) for k, v in totals.items() if v > 0},
                **({"by_step": parts} if parts else {}),
                "bytes_to_device": self.bytes_to_device, "bytes_to_host": self.bytes_to_host}
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            self._device_peak = max(self._device_peak, peak)
            line["peak_device_mib"] = round(peak / 2**20, 1)
            torch.cuda.reset_peak_memory_stats(self.device)
        line["host_rss_mib"] = round(current_rss() / 2**20, 1)
        line["host_high_water_mib"] = round(high_water_bytes() / 2**20, 1)
        line["at_s"] = round(time.perf_counter() - self._started, 3)
        line["unix_s"] = round(time.time(), 3)
        if self._file is None:
            resumed = self.append and is_timings_log(self.path)
            self._file = self.path.open("a", encoding="utf-8") if resumed else open_fresh(self.path)
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        if self.profiler is not None:
            self.profiler.step()
        self._seconds.clear()
        self._parts.clear()
        self.bytes_to_device = self.bytes_to_host = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


#: The marker type (``cleanup.MARKER``) of a ``--profile`` directory: one that a later run may write into again.
PROFILE_KIND = "recipe-profile"

#: Records (layers) the profiler skips, warms up on and traces (``profiled``): a few layers of the first pass.
PROFILE_SCHEDULE = dict(wait=1, warmup=1, active=3, repeat=1)


@contextlib.contextmanager
def profiled(timings: Timings, directory: Path | None) -> Iterator[None]:
    """``recipe apply --profile DIR``: a ``torch.profiler`` trace of a few layers (``PROFILE_SCHEDULE``, one
    profiler step per timings record) written to ``DIR/trace.json`` (Chrome / Perfetto format; each phase marked
    ``phase:NAME``, see ``benchmarks/diagnosis/gpu_gaps.py``), and the top operations by host and by device time in
    ``DIR/top_operations.txt``. A no-op without a directory."""
    if directory is None or not timings.enabled:
        yield
        return
    # deferred: the profiler module is needed only under --profile
    from torch.profiler import ProfilerActivity, profile, schedule

    directory.mkdir(parents=True, exist_ok=True)
    write_marker(directory, PROFILE_KIND, "complete")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if timings.device.type == "cuda" else [])

    def write(profiler) -> None:
        trace = directory / ".trace.json.tmp"
        profiler.export_chrome_trace(str(trace))
        os.replace(trace, directory / "trace.json")
        averages = profiler.key_averages()
        tables = [f"top operations of {PROFILE_SCHEDULE['active']} profiled layers (by self host time)",
                  averages.table(sort_by="self_cpu_time_total", row_limit=25)]
        if timings.device.type == "cuda":
            tables += ["by self device time", averages.table(sort_by="self_cuda_time_total", row_limit=25)]
        replace_text(directory / "top_operations.txt", "\n".join(tables) + "\n")

    with profile(activities=activities, schedule=schedule(**PROFILE_SCHEDULE), on_trace_ready=write) as profiler:
        timings.profiler = profiler
        try:
            yield
        finally:
            timings.profiler = None


def read_timings(path: Path) -> list[dict[str, Any]]:
    """The records of a timings log (a last line cut by a kill is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Seconds by phase summed per step (the ``step`` field), for tables."""
    totals: dict[str, dict[str, float]] = {}
    for record in records:
        step = totals.setdefault(record.get("step", "?"), defaultdict(float))
        for phase, seconds in record.get("seconds", {}).items():
            step[phase] += seconds
    return {step: dict(phases) for step, phases in totals.items()}
