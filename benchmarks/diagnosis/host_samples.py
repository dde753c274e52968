"""Where a run's host time goes, from py-spy's raw samples (``py-spy record --idle --threads --format raw``):
wall-clock shares by thread, and for the main thread by the engine phase a sample was in (the innermost
``recipe_engine`` frame of a listed phase function) and by the frames under it that held the most samples.

    python -m benchmarks.diagnosis.host_samples SAMPLES.txt [--rate 50] [--under write_checkpoint] [--top 30]

``python -m benchmarks.acceptance --sample-host PY_SPY`` runs its ``recipe apply`` runs under py-spy and writes this
summary beside the samples (``host-NAME.txt``): with ``--idle`` a thread waiting on the GPU, a lock or the disk is
counted, so the shares are of wall time, not of CPU time."""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def read_samples(path: Path) -> list[tuple[list[str], int]]:
    """``(frames outermost first, count)`` per line of py-spy's raw (collapsed-stack) output."""
    samples = []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples.append((stack.split(";"), int(count)))
    return samples


def summarize(samples: list[tuple[list[str], int]], rate: float, under: str, top: int, threads: bool = True) -> str:
    """Seconds per thread (its first frame names it with ``--threads``; ``threads``: listed), and within the
    samples whose stack passes through a frame containing ``under``: the frames below it by inclusive seconds."""
    by_thread, inside, total_under = Counter(), Counter(), 0
    for frames, count in samples:
        by_thread[frames[0]] += count
        depth = next((i for i, frame in enumerate(frames) if under in frame), None)
        if depth is None:
            continue
        total_under += count
        for frame in set(frames[depth + 1:]):
            inside[frame] += count
    lines = ["seconds by thread (wall time with --idle):"] if threads else []
    lines += [f"  {count / rate:8.2f}  {thread}" for thread, count in by_thread.most_common() if threads]
    lines.append(f"under {under!r}: {total_under / rate:.2f} s; the frames below it by inclusive seconds:")
    lines += [f"  {count / rate:8.2f}  {frame}" for frame, count in inside.most_common(top)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", type=Path)
    parser.add_argument("--rate", type=float, default=50, help="py-spy's sampling rate (-r)")
    parser.add_argument("--under", nargs="+", default=["cmd_apply", "write_checkpoint", "run_layer"],
                        help="frames (their text) to break down")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    print(breakdown(read_samples(args.samples), args.rate, args.under, args.top), end="")


def breakdown(samples, rate: float, unders: list[str], top: int) -> str:
    """The threads, then each of ``unders`` broken down (:func:`summarize`)."""
    return "".join(summarize(samples, rate, under, top, threads=i == 0) for i, under in enumerate(unders))


if __name__ == "__main__":
    main()
