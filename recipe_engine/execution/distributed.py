"""Data-parallel calibration over processes: the one engine module that uses ``torch.distributed``.

Launch: ``torchrun --nproc-per-node N -m recipe_engine.cli apply RECIPE`` (also ``accelerate launch`` and
multi-node through torchrun's rendezvous): ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` pick this process;
gloo on CPU, NCCL on CUDA (device ``cuda:LOCAL_RANK``). Rank 0 writes the output; the others write nothing.

Design (no modifier needs to know; llm-compressor's DDP oneshot splits the dataset the same way):

* **Split layer runs, replicated activations.** Every rank holds the same calibration tokens and the same
  activations. ``LayerPipeline.run_layer`` runs rank r's contiguous share of the batches (``share``: batches
  ``[r·B/N, (r+1)·B/N)``, deterministic), then all-gathers the outputs (``gather``), so every rank goes on
  with every batch's output in the global order: bit-identical to a one-process run (same per-batch
  arithmetic). Anything a step computes from activations (similarities, Block Influence, targets, solves)
  therefore sees exactly what it sees in one process.
* **fp64 all-reduce of statistics.** The statistics hooked on a split run saw only the rank's batches. Each
  statistic class names its sums (``Statistic.sums``: e.g. a Gram and its token count); they are all-reduced
  in fp64 when the run ends, the point where the layer's statistic is complete. All ranks then hold the same
  bits and compute the same compression; the only difference from one process is the order of the fp64
  additions (~1e-16 relative).
* **Replicated where the engine cannot reduce.** A run with a per-batch callback (``on_batch``: the caller
  accumulates itself), a run with fewer batches than ranks and steps that build their own session run every
  batch on every rank: correct, no speed-up. ``StagedLayer``'s piecewise runs are split like layer runs.
* **Spread solves.** ``map`` (``ModifierSession.map``) gives each rank a share of independent items (e.g. HeadPrune's
  candidate subsets, one ridge solve each) and all-gathers the results.
* **Guard.** After each compressed layer and each model-scope step the ranks compare a sha256 of the layer's
  weights (of the step's report, the layer structure and the materialized weights): a mismatch stops every
  rank with one line.
* **Failure.** Every collective starts with a status all-reduce. A rank that raises joins the next status as
  "failed" with its message, so every other rank stops at its next collective with one line naming the
  failing rank, exit 1, nothing written. A hung or killed peer ends the collectives after
  ``RECIPE_DIST_TIMEOUT`` seconds (default 1800) or when its connection closes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from ..errors import OutOfMemory, one_line


class DistributedError(Exception):
    """A data-parallel run stopped on every rank (exit code 1, nothing written); the message is one line."""

    exit_code = 1


class RankFailed(DistributedError):
    """Another rank raised; this one stopped at its next collective. ``out_of_memory``: that rank ran out of
    memory (``OutOfMemory``), so rank 0 keeps the resume checkpoints as that rank says
    (``failures.discard_on_error``)."""

    def __init__(self, message: str, out_of_memory: bool = False):
        super().__init__(message)
        self.out_of_memory = out_of_memory


class RanksDiverged(DistributedError):
    """The ranks' compressed weights differ although their statistics were all-reduced."""


class Parallel:
    """This process's place in a data-parallel run; one process is rank 0 of 1 (every method a no-op)."""

    def __init__(self, rank: int = 0, world: int = 1, device: torch.device = torch.device("cpu"),
                 comm: torch.device = torch.device("cpu"), grouped: bool | None = None):
        self.rank, self.world, self.device, self.comm = rank, world, device, comm
        #: The collectives run through a process group (a launch, also of one rank); else every method is a no-op.
        self.grouped = world > 1 if grouped is None else grouped
        self._stopped = False

    @property
    def active(self) -> bool:
        return self.grouped

    def share(self, batches: int) -> range | None:
        """This rank's contiguous share of ``batches`` (None: not split, every rank runs all of them)."""
        if not self.active or batches < self.world:
            return None
        return range(self.rank * batches // self.world, (self.rank + 1) * batches // self.world)

    def split(self, batches: int, shared: bool = True) -> "Split":
        """A run over ``batches`` calibration batches, this rank's share of them and what follows it
        (:class:`Split`); ``shared=False``: every rank runs every batch (e.g. a run with a per-batch callback)."""
        return Split(self, batches, self.share(batches) if shared else None)

    # -- failure protocol ----------------------------------------------------------------------
    def _status(self, failure: str | None = None) -> None:
        """All-reduce who failed; a rank that did not fail raises :class:`RankFailed` if any did."""
        flags = torch.zeros(self.world, dtype=torch.int64, device=self.comm)
        flags[self.rank] = failure is not None
        dist.all_reduce(flags)
        if not bool(flags.any()):
            return
        messages: list[Any] = [None] * self.world
        dist.all_gather_object(messages, failure)
        self._stopped = True
        if failure is None:
            failed = [r for r in range(self.world) if flags[r]]
            raise RankFailed(f"rank {self.rank}: stopped because rank {failed[0]} failed: {messages[failed[0]]}",
                             out_of_memory=str(messages[failed[0]]).startswith(f"{OutOfMemory.__name__}: "))

    def abort(self, exc: BaseException) -> None:
        """Tell the other ranks that this one failed (they stop at their next collective)."""
        if not self.active or self._stopped:
            return
        self._stopped = True
        text = str(exc) if isinstance(exc, DistributedError) else f"{type(exc).__name__}: {exc}"
        try:
            self._status(one_line(text))
        except Exception:  # noqa: BLE001 - peers already gone: their connection errors end them
            pass

    def barrier(self) -> None:
        """A sync point: returns when every rank got here, raises :class:`RankFailed` if one failed."""
        if self.active:
            self._status()

    # -- collectives ---------------------------------------------------------------------------
    def reduce_statistics(self, statistics: Iterable) -> None:
        """All-reduce (sum, fp64) the ``sums`` of each statistic in place; numbers stay numbers."""
        if not self.active:
            return
        self._status()
        for stat in statistics:
            names = type(stat).sums
            if names is None:
                raise RuntimeError(f"statistic {stat.key} declares no sums (Statistic.sums): it cannot be "
                                   f"all-reduced over ranks")
            numbers = [n for n in names if isinstance(getattr(stat, n), (int, float))]
            for name in names:
                value = getattr(stat, name)
                if isinstance(value, torch.Tensor):
                    total = value.to(device=self.comm, dtype=torch.float64)
                    dist.all_reduce(total)
                    setattr(stat, name, total.to(device=value.device, dtype=value.dtype))
            if numbers:
                packed = torch.tensor([float(getattr(stat, n)) for n in numbers], dtype=torch.float64,
                                      device=self.comm)
                dist.all_reduce(packed)
                for name, total in zip(numbers, packed.tolist()):
                    setattr(stat, name, type(getattr(stat, name))(total))

    def map(self, function, items: list) -> list:
        """``[function(x) for x in items]`` with the items spread over the ranks (contiguous shares) and the
        results all-gathered, so every rank returns the same list (results must be picklable)."""
        share = self.share(len(items))
        if share is None:
            return [function(item) for item in items]
        mine = [function(items[k]) for k in share]
        self._status()
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine)
        return [result for part in every for result in part]

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise fp64 sum of ``values`` over ranks."""
        if not self.active:
            return values
        self._status()
        packed = torch.tensor(values, dtype=torch.float64, device=self.comm)
        dist.all_reduce(packed)
        return packed.tolist()

    def gather(self, local: list[torch.Tensor], batches: int) -> list[torch.Tensor]:
        """Every rank's ``local`` outputs (its ``share`` of ``batches``) in global batch order, on every rank;
        tensors travel as raw bytes (any dtype, exact)."""
        self._status()
        storage = local[0].device
        header = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in local]
        headers: list[Any] = [None] * self.world
        dist.all_gather_object(headers, header)
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in local]).to(self.comm)
        sizes = [sum(_nbytes(shape, dtype) for shape, dtype in h) for h in headers]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=self.comm)
        padded[: flat.numel()] = flat
        buffers = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(buffers, padded)
        result = []
        for buffer, h in zip(buffers, headers):
            offset = 0
            for shape, dtype in h:
                size = _nbytes(shape, dtype)
                chunk = buffer[offset: offset + size].clone().view(getattr(torch, dtype)).view(shape)
                result.append(chunk.to(storage))
                offset += size
        if len(result) != batches:
            raise RuntimeError(f"gathered {len(result)} batches, expected {batches}")
        return result

    def agree(self, what: str, digest: str) -> None:
        """Stop every rank with one line unless all ranks computed the same sha256 ``digest``."""
        if not self.active:
            return
        self._status()
        words = torch.tensor([int(digest[i: i + 15], 16) for i in range(0, 60, 15)], dtype=torch.int64,
                             device=self.comm)
        every = [torch.empty_like(words) for _ in range(self.world)]
        dist.all_gather(every, words)
        differ = [r for r in range(self.world) if not torch.equal(every[r], every[0])]
        if differ:
            self._stopped = True  # every rank saw the same gather: all stop here, no status needed
            raise RanksDiverged(f"ranks {[0] + differ} computed different weights for {what} after the fp64 "
                                f"all-reduce (non-deterministic kernels or different library versions?)")


class Split:
    """One run over ``batches`` batches shared out over the ranks: ``share`` (this rank's batches; None: every rank
    runs all of them) and, after the run, the one reduction of what the share computed: statistics all-reduced
    (:meth:`reduce`), numbers summed (:meth:`sum`), outputs all-gathered (:meth:`gather`), each a no-op when the
    batches were not split. Every caller that shares a run (the layer pass, staged layers, the calibration loss,
    a step's own statistics) goes through it."""

    def __init__(self, parallel: Parallel, batches: int, share: range | None):
        self.parallel, self.batches, self.share = parallel, batches, share

    @property
    def own(self) -> list[int]:
        """The batches this process runs, in order."""
        return list(self.share if self.share is not None else range(self.batches))

    def reduce(self, statistics: Iterable) -> bool:
        """All-reduce the statistics' sums (fp64) when the batches were split; whether they were."""
        if self.share is None:
            return False
        self.parallel.reduce_statistics(list(statistics))
        return True

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise fp64 sum of ``values`` over the ranks when the batches were split."""
        return values if self.share is None else self.parallel.sum(values)

    def gather(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's outputs of its share, in batch order, when the batches were split."""
        return outputs if self.share is None else self.parallel.gather(outputs, self.batches)


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def module_digest(module: torch.nn.Module, extra: Any = None) -> str:
    """sha256 of a module's materialized tensors (names, shapes, dtypes, bytes; meta tensors by name and
    shape only) and of ``extra`` (JSON)."""
    sha = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for name, tensor in sorted(module.state_dict(keep_vars=True).items()):
        sha.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        if tensor.device.type != "meta":
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            sha.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return sha.hexdigest()


def world_size() -> int:
    """Ranks of the launch this process belongs to (``WORLD_SIZE``; 1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_by_torchrun() -> bool:
    """Started by a distributed launcher (torchrun sets ``WORLD_SIZE`` and the rendezvous ``MASTER_ADDR``),
    even with one rank: ``torchrun --nproc-per-node 1`` runs every collective through a one-rank group, so
    one GPU checks the NCCL path end to end (``benchmarks/acceptance``)."""
    return "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


@contextlib.contextmanager
def launched(device: torch.device) -> Iterator[Parallel]:
    """The run's :class:`Parallel`: initializes the default process group under a distributed launch (and
    destroys it after, if it created it). An exception on this rank is announced to the others first."""
    if world_size() <= 1 and not launched_by_torchrun():
        yield Parallel(device=device)
        return

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    created = not dist.is_initialized()
    if created:
        timeout = timedelta(seconds=float(os.environ.get("RECIPE_DIST_TIMEOUT", "1800")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    parallel = Parallel(dist.get_rank(), dist.get_world_size(), device, comm, grouped=True)
    try:
        yield parallel
    except BaseException as exc:
        parallel.abort(exc)
        raise
    finally:
        if created:
            dist.destroy_process_group()
