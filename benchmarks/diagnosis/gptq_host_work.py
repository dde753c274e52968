"""The host's share of GPTQ on a mixture-of-experts layer: what it asks of the host per layer, counted on CPU.

    OMP_NUM_THREADS=2 python -m benchmarks.diagnosis.gptq_host_work --work /tmp/hostwork [--shape qwen3-30b-a3b
        --layers 1 --samples 128 --seq-len 256 --batch-size 4] [--out FILE.json]

On a GPU a layer's expert solves are hundreds of thousands of small kernels; the GPU stays busy only while the
host queues work faster than the GPU runs it. Three things stop the host from running ahead: a host read of a
GPU value (``bool``/``float``/``item``/``tolist`` waits for every kernel queued before it), a CUDA graph
capture (the block program run eagerly twice, kernel by kernel from Python) and a factorization (its
positive-definiteness check is such a read). This script counts them per layer on CPU, where the engine runs
the same code with the accelerator's batch sizes (``_experts.budgets``): host reads of tensor values (a
``torch.overrides`` mode over the GPTQ step's layers), GPTQ sweeps (``gptq_quantize_batch`` calls), Hessian
factorizations, and block programs built (the sweep forced through its static-buffer path, which on a GPU is
one capture each). It also counts the kernels the host launches one by one (:class:`Launches`: every operation
dispatched from Python but views, allocations and host reads; a block program's run counts once, as a graph
replay): at a few microseconds of host time each, they bound how fast the host can queue a layer. The counts
depend on the shapes, the batch sizes and the number of calibration batches (``--samples / --batch-size``: the
GPU acceptance's 128 × 2048 at batch 4 is 32 batches) and, a little, the tokens per batch (how many experts'
``down_proj`` inputs one pass over the batches computes), not on the machine.

Models (bf16, random weights, SmolLM2's tokenizer and vocabulary): ``small`` (hidden 256, 128 experts of width
128, top-4, 4 / 2 heads of 64) or ``qwen3-30b-a3b`` (Qwen3-30B-A3B's layer shape), ``--layers`` layers;
``GPTQ<bits:4,group_size:128>`` (``--export``: compressed-tensors, the packed default, or dequantized) on every
linear and expert, WikiText-2 calibration. With a packed export the host reads of writing the output (packing
every expert) are counted too.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.acceptance.moe import QWEN3_30B_A3B, write_moe_checkpoint

ROOT = Path(__file__).resolve().parents[2]

HOST_READS = {"__bool__", "__float__", "__int__", "__index__", "item", "tolist", "nonzero", "equal"}


class HostReads(TorchFunctionMode):
    """Counts tensor operations that hand a tensor's value to Python (on a GPU: a synchronisation)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


#: Operations that launch no kernel: allocation, aliasing, and the host read itself (counted by :class:`HostReads`).
NO_KERNEL = {"empty", "empty_strided", "detach", "lift_fresh", "alias", "_local_scalar_dense"}


class Launches(TorchDispatchMode):
    """Counts the operations dispatched from Python that launch a kernel on a GPU (views, allocations and
    host reads excluded), by operation; ``program()`` wraps a captured block program's run, which on a GPU is one
    graph replay however many operations it holds (counted as ``graph replay``)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()
        self.inside_program = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.inside_program and not func.is_view and name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def program(self, run):
        def replay():
            self.counts["graph replay"] += 1
            self.inside_program = True
            try:
                return run()
            finally:
                self.inside_program = False
        return replay


SHAPES = {"small": dict(hidden_size=256, num_experts=128, num_experts_per_tok=4, moe_intermediate_size=128,
                        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        vocab_size=49152, tie_word_embeddings=False, norm_topk_prob=True),
          "qwen3-30b-a3b": QWEN3_30B_A3B}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--export", default="compressed-tensors", choices=["compressed-tensors", "dequantized"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import recipe_engine
    from recipe_engine.modifiers import _experts, gptq
    from recipe_engine.workflows import runner

    model = write_moe_checkpoint(args.work / f"{args.shape}-{args.layers}", args.layers, "cpu", "smollm2-135m",
                                 SHAPES[args.shape])
    data = Path(os.environ.get("RECIPE_DATA_DIR", ROOT / "data")) / "wikitext-2-raw" / "wiki.valid.raw"
    counts, reads = Counter(), HostReads()

    def counted(name, function):
        def wrapper(*a, **k):
            counts[name] += 1
            return function(*a, **k)
        return wrapper

    _experts.on_accelerator = lambda device: True  # the accelerator's batch sizes (``_experts.budgets``)
    gptq.inverse_hessian_factor = counted("factorizations", gptq.inverse_hessian_factor)
    launches, build = Launches(), counted("block programs built", gptq._BlockGraph.__init__)

    def build_counted(self, *a, **k):  # off a GPU the program runs eagerly: its operations count as one replay
        build(self, *a, **k)
        self.program = launches.program(self.program)

    gptq._BlockGraph.__init__ = build_counted
    sweep = gptq.gptq_quantize_batch

    def through_static_buffers(*a, **k):  # graphs=True, given by position or by name
        return sweep(*a[:6], True, *a[7:], **k) if len(a) > 6 else sweep(*a, **{**k, "graphs": True})

    gptq.gptq_quantize_batch = counted("sweeps", through_static_buffers)
    compress = gptq.GPTQ.compress_layer

    def compress_counted(self, *a, **k):
        with reads, launches:
            return compress(self, *a, **k)

    gptq.GPTQ.compress_layer = compress_counted
    write, write_reads = runner.write_checkpoint, HostReads()

    def write_counted(*a, **k):
        with write_reads:
            return write(*a, **k)

    runner.write_checkpoint = write_counted
    recipe = {"version": 1, "name": "host-work", "model": str(model), "dtype": "bfloat16",
              "calibration": {"dataset": str(data), "samples": args.samples, "seq_len": args.seq_len,
                              "batch_size": args.batch_size},
              "modifiers": [f"GPTQ<bits:4,group_size:128,export:{args.export}>"], "output": str(args.work / "out")}
    path = args.work / "recipe.json"
    path.write_text(json.dumps(recipe))
    started = time.perf_counter()
    recipe_engine.apply(str(path), progress=False, force=True)
    wall = time.perf_counter() - started
    figures = {"shape": args.shape, "layers": args.layers, "tokens": args.samples * args.seq_len,
               "wall_s": round(wall, 1), "host_reads_per_layer": sum(reads.counts.values()) / args.layers,
               "host_reads_by_kind": dict(reads.counts),
               "kernel_launches_per_layer": sum(launches.counts.values()) / args.layers,
               "graph_replays_per_layer": launches.counts["graph replay"] / args.layers,
               "launches_by_operation": dict(launches.counts.most_common(12)),
               "output_write_host_reads_per_layer": sum(write_reads.counts.values()) / args.layers,
               **{f"{name.replace(' ', '_')}_per_layer": value / args.layers for name, value in sorted(counts.items())}}
    for key, value in figures.items():
        print(f"{key:32} {value}")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
