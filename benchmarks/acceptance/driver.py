"""The GPU acceptance's driver: ``python -m benchmarks.acceptance`` (``benchmarks/acceptance/__init__.py`` has the
legs, the goals and the calls on a lent GPU). Runs the chosen legs in order under one budget, records each
leg's figures and rows in OUT/gpu_acceptance.json (rewritten after every leg) and prints the table."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import benchmarks.acceptance as package
from benchmarks.acceptance import carry, runs
from benchmarks.acceptance.bench import GOAL_DECODE_BUSY, GOAL_OF_LIMIT, GOAL_REPEATABLE, GOAL_WARMUP_S, leg_bench
from benchmarks.acceptance.dp import leg_dp
from benchmarks.acceptance.graphs import leg_graphs
from benchmarks.acceptance.moe import leg_moe
from benchmarks.acceptance.offload import leg_offload
from benchmarks.acceptance.result import machine, pack_runs, table, write_result
from benchmarks.acceptance.runs import GOAL_GPU_OVER_ESTIMATE, LegError, disk_write_speed, row
from benchmarks.acceptance.smollm2 import GOAL_PPL_RELATIVE, REFERENCE, leg_smollm2
from benchmarks.acceptance.stream8b import GOAL_FLATTEN_S, GOAL_GPTQ_S, LLAMA3_8B_LAYERS, leg_stream8b
from benchmarks.acceptance.w4 import GOAL_W4_BYTES, GOAL_W4_DECODE, leg_w4

# the order legs run in, whatever order --legs names them: the serving goals first (the reason for a lease), then
# the quick legs (a long one cannot starve them)
LEGS = ("bench", "w4", "graphs", "smollm2", "dp", "offload", "stream8b", "moe")


def default_work(out: Path, tiny: bool) -> Path:
    """Work directory: ``/dev/shm`` (memory) on a full run where it exists — a lent machine's disk writes
    back at ~85 MB/s, slower than a checkpoint is written —, else ``OUT/work``."""
    shm = Path("/dev/shm")
    if not tiny and shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "recipe-acceptance"
    return out / "work"


#: Every leg's goals, recorded in the result
GOALS = {"flatten_s": GOAL_FLATTEN_S, "gptq_s": GOAL_GPTQ_S, "gpu_over_estimate": GOAL_GPU_OVER_ESTIMATE,
         "ppl_relative": GOAL_PPL_RELATIVE, "tokens_per_s_of_bytes_limit": GOAL_OF_LIMIT, "warmup_s": GOAL_WARMUP_S,
         "decode_busy": GOAL_DECODE_BUSY, "invocations_apart": GOAL_REPEATABLE, "w4_bytes": GOAL_W4_BYTES,
         "w4_decode": GOAL_W4_DECODE}


def run(args) -> int:
    runs.HOST_SAMPLER = args.sample_host
    if args.engine:
        if not (Path(args.engine) / "recipe_engine" / "cli" / "__main__.py").is_file():
            raise SystemExit(f"error: --engine {args.engine}: no recipe_engine package there")
        runs.ENGINE = Path(args.engine).resolve()
    runs.DEADLINE = time.monotonic() + 60 * args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs.OUT = out.resolve()
    work = Path(args.work) if args.work else default_work(out, args.tiny)
    work.mkdir(parents=True, exist_ok=True)
    import torch

    torch.manual_seed(0)
    result = {"format": "gpu-acceptance/1", "machine": machine(args.device), "tiny": args.tiny, "goals": GOALS,
              "legs": {}, "rows": [], "complete": False}
    result["machine"].update(engine=str(runs.ENGINE), work=str(work), disk_write_mb_s={str(out): disk_write_speed(out),
                                                              str(work): disk_write_speed(work)})
    print(f"[{time.strftime('%H:%M:%S')}] write speed (MB/s, synced): {result['machine']['disk_write_mb_s']}",
          flush=True)
    legs = {"graphs": lambda: leg_graphs(args, work / "graphs"),
            "smollm2": lambda: leg_smollm2(args, work / "smollm2"),
            "stream8b": lambda: leg_stream8b(args, work / "stream8b"),
            "bench": lambda: leg_bench(args, work / "bench"),
            "w4": lambda: leg_w4(args, work / "w4"),
            "dp": lambda: leg_dp(args, work / "dp"),
            "offload": lambda: leg_offload(args, work / "offload"),
            "moe": lambda: leg_moe(args, work / "moe")}
    for leg in sorted(dict.fromkeys(args.legs), key=LEGS.index):
        (work / leg).mkdir(parents=True, exist_ok=True)
        print(f"[{time.strftime('%H:%M:%S')}] {leg} ...", flush=True)
        started = time.perf_counter()
        try:
            figures, rows = legs[leg]()
            record = {"status": "ok", "figures": figures}
            result["rows"] += rows
        except Exception as exc:  # noqa: BLE001 - a failing leg is recorded and the next one runs
            text = f"{type(exc).__name__}: {exc}" if not isinstance(exc, LegError) else str(exc)
            record = {"status": "error", "error": (text.strip().splitlines() or [""])[0]}
            result["rows"].append(row(leg, "leg ran", None, "", "no error", False, error=record["error"]))
        record["wall_s"] = round(time.perf_counter() - started, 1)
        result["legs"][leg] = record
        write_result(out, result)
        if args.pack:
            pack_runs(out, work)
        print(f"[{time.strftime('%H:%M:%S')}] {leg}: {record['status']} ({record['wall_s']} s)"
              + (f": {record['error']}" if record["status"] != "ok" else ""), flush=True)
    if args.write_reference:
        if args.tiny or "smollm2" not in result["legs"] or result["legs"]["smollm2"]["status"] != "ok":
            raise SystemExit("error: --write-reference needs a full (not --tiny) smollm2 leg that succeeded")
        REFERENCE.write_text(json.dumps({"machine": result["machine"],
                                         "figures": result["legs"]["smollm2"]["figures"]["figures"]}, indent=2) + "\n")
    result["complete"] = True
    write_result(out, result)
    if not args.keep_work and not args.work:
        clear_work(out, work)
    print(table(result))
    return 0


def clear_work(out: Path, work: Path) -> None:
    """Checkpoints and outputs go; each run's log and recipe stay (in OUT/work)."""
    for leg_directory in work.iterdir():
        for child in leg_directory.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            elif work != out / "work":  # logs and recipes of a work directory outside OUT: into OUT
                (out / "work" / leg_directory.name).mkdir(parents=True, exist_ok=True)
                shutil.copy(child, out / "work" / leg_directory.name / child.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=package.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda | cuda:i | cpu (default cuda)")
    parser.add_argument("--tiny", action="store_true", help="tiny random models: seconds per leg (the test suite)")
    parser.add_argument("--out", help="directory for gpu_acceptance.json and OUT/work (checkpoints and outputs, "
                                      "removed at the end; every run's log and recipe kept)")
    parser.add_argument("--legs", nargs="+", choices=LEGS, default=list(LEGS))
    parser.add_argument("--samples", type=int, default=128, help="stream8b calibration windows (paper: 128)")
    parser.add_argument("--seq-len", type=int, default=2048, help="stream8b window length (paper: 2048)")
    parser.add_argument("--layers", type=int, default=LLAMA3_8B_LAYERS,
                        help="stream8b: decoder layers of the 8B-shaped checkpoint (fewer: its figures are "
                             "extrapolated to 32 layers, labelled as such; FlattenGPT's merges scale with them)")
    parser.add_argument("--moe-layers", type=int, default=8,
                        help="moe: decoder layers of the Qwen3-30B-A3B-shaped checkpoint (of its 48; all 128 experts)")
    parser.add_argument("--budget", type=float, default=20.0,
                        help="minutes for all legs; a run still going then is stopped and its leg recorded as failed")
    parser.add_argument("--work", help="work directory (checkpoints, outputs; kept) instead of OUT/work")
    parser.add_argument("--keep-work", action="store_true", help="keep OUT/work whole")
    parser.add_argument("--write-reference", action="store_true",
                        help="store the smollm2 leg's figures as the committed CPU reference")
    parser.add_argument("--prepare-carry", metavar="DIR", help="here: build the carry directory and stop")
    parser.add_argument("--carry", metavar="DIR", help="there: install and place what --prepare-carry built")
    parser.add_argument("--tokenizer", default="smollm2-135m",
                        help="the 8B-shaped checkpoint's tokenizer: a model alias or directory (--carry sets it)")
    parser.add_argument("--bench-repeats", type=int, default=30,
                        help="bench and w4: timed iterations per model and request (30 or more)")
    parser.add_argument("--bench-compile", choices=["graphs", "on"], default="graphs",
                        help="bench and w4 on a GPU: the decode step captured as CUDA graphs from its eager kernels "
                             "(graphs, seconds of warm-up) or torch.compile'd (on: inductor too, minutes)")
    parser.add_argument("--profile", action="store_true",
                        help="moe: profile a few layers of its run (torch.profiler; the top operations by host "
                             "and device time in runs.tar.gz; those layers' timings are slower)")
    parser.add_argument("--engine", metavar="DIR",
                        help="run every recipe apply with the recipe_engine package in DIR (e.g. `git archive COMMIT "
                             "recipe_engine | tar -x -C DIR`), this harness otherwise: two engines on one machine")
    parser.add_argument("--sample-host", metavar="PY_SPY",
                        help="run every recipe apply under this py-spy executable (wall time by thread and frame; "
                             "OUT/host-NAME.txt, summarized by benchmarks/diagnosis/host_samples.py; peak RSS is "
                             "then py-spy's)")
    parser.add_argument("--pack", action="store_true",
                        help="timings logs, GPU traces and run logs in one OUT/runs.tar.gz (few files to send back)")
    parser.add_argument("--detach", action="store_true", help="run in a new process session (log: OUT/acceptance.log)")
    parser.add_argument("--follow", type=float, metavar="SECONDS", help="print OUT's log until done or SECONDS pass")
    args = parser.parse_args(argv)
    if args.prepare_carry:
        carry.prepare_carry(Path(args.prepare_carry))
        return 0
    if not args.out:
        parser.error("--out is required")
    out = Path(args.out)
    if args.follow is not None and not args.detach:
        return carry.follow(out, args.follow)
    carried = carry.unpack_carry(Path(args.carry)) if args.carry else None
    args.tokenizer = carried or args.tokenizer
    problem = carry.check_imports()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
            return 2
    if args.detach:
        own = list(argv if argv is not None else sys.argv[1:])
        return carry.detach(own, out, carried, args.follow or 0)
    return run(args)
