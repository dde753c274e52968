"""Where a GPU waits: the idle gaps between its kernels in a ``recipe apply --profile`` trace, by phase and by the
host operation running when each gap began.

    python -m benchmarks.diagnosis.gpu_gaps PROFILE_DIR/trace.json [--out gaps.txt]

``nvidia-smi`` says how busy a GPU was; this says why it was not. From the profiler's Chrome trace: the device's
busy time (the union of its kernels, copies and memsets) over the profiled window, and every gap between them,
charged to the engine's phase at the gap's start (``Timings.phase`` marks ``phase:compress``, ``phase:write``, …
while profiling) and to the innermost host operation (``cpu_op``) running then, e.g. ``aten::_local_scalar_dense``
for a read of a GPU value, ``cudaHostAlloc`` for pinned memory. The GPU acceptance's moe leg writes this table
beside ``top_operations.txt`` (``gaps.txt``): a trace of a few layers is too large to bring back.
"""
from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: Gaps shorter than this are charged to their phase only (a kernel launch's own latency).
ATTRIBUTED_GAP_US = 20.0


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The union of the device's events as sorted, disjoint ``(start, end)`` intervals (µs)."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


class Innermost:
    """The innermost of (possibly nested) host intervals containing a time: the latest-starting one that has
    not ended. Intervals that end before the time are skipped by scanning back from it (bounded)."""

    def __init__(self, intervals: list[tuple[float, float, str]], scan: int = 256):
        self.intervals = sorted(intervals)
        self.starts = [start for start, _, _ in self.intervals]
        self.scan = scan

    def at(self, time: float) -> str | None:
        index = bisect.bisect_right(self.starts, time) - 1
        for k in range(index, max(-1, index - self.scan), -1):
            start, end, name = self.intervals[k]
            if end >= time:
                return name
        return None


def gap_summary(trace: dict, top: int = 15) -> dict:
    """Busy and idle time of the device over the profiled window, the idle time by phase and by the host
    operation at each gap's start (gaps of at least :data:`ATTRIBUTED_GAP_US`), and the ``top`` longest gaps."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    busy = busy_intervals(events)
    if not busy:
        return {"device_events": 0}
    window = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)
    marks = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("phase:")]
    phases = Innermost([(e["ts"], e["ts"] + e.get("dur", 0), e["name"][len("phase:"):]) for e in marks])
    engine = {e.get("tid") for e in marks}  # the thread that runs the pass (not a reader's or writer's)
    operations = Innermost([(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")
                            and (not engine or e.get("tid") in engine)])
    by_phase: dict[str, float] = defaultdict(float)
    by_operation: dict[str, float] = defaultdict(float)
    gaps = []
    for (_, end), (start, _) in zip(busy, busy[1:]):
        length = start - end
        phase = phases.at(end) or "(outside a phase)"
        by_phase[phase] += length
        if length >= ATTRIBUTED_GAP_US:
            operation = operations.at(end) or "(no host operation)"
            by_operation[operation] += length
            gaps.append((length, end - busy[0][0], phase, operation))
    gaps.sort(reverse=True)
    idle = window - busy_us
    return {"device_events": len(busy), "window_s": window / 1e6, "busy_s": busy_us / 1e6,
            "busy_share": busy_us / window if window else None, "idle_s": idle / 1e6,
            "idle_by_phase_s": {k: v / 1e6 for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])},
            "idle_by_operation_s": {k: v / 1e6 for k, v in sorted(by_operation.items(), key=lambda kv: -kv[1])[:top]},
            "longest_gaps": [{"ms": length / 1e3, "at_s": at / 1e6, "phase": phase, "operation": operation}
                             for length, at, phase, operation in gaps[:top]]}


def format_summary(summary: dict) -> str:
    if not summary.get("device_events"):
        return "no device events in the trace (a CPU run, or the profiler saw no GPU)\n"
    lines = [f"device busy {summary['busy_s']:.3f} s of {summary['window_s']:.3f} s profiled "
             f"({summary['busy_share']:.1%}); idle {summary['idle_s']:.3f} s",
             "", "idle by phase (at each gap's start):"]
    lines += [f"  {seconds:9.3f} s  {phase}" for phase, seconds in summary["idle_by_phase_s"].items()]
    lines += ["", f"idle by the host operation at the start of each gap of {ATTRIBUTED_GAP_US:g} µs or more:"]
    lines += [f"  {seconds:9.3f} s  {operation}" for operation, seconds in summary["idle_by_operation_s"].items()]
    lines += ["", "longest gaps:"]
    lines += [f"  {g['ms']:9.3f} ms at {g['at_s']:8.3f} s  {g['phase']:10}  {g['operation']}"
              for g in summary["longest_gaps"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = format_summary(gap_summary(json.loads(args.trace.read_text())))
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
