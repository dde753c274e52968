"""The calibration activations of a pass: one owner for where they live and how a batch reaches the device.

:class:`Activations` holds, per calibration batch, the hidden states entering a decoder layer and the keyword
arguments the layers take (attention masks, rotary embeddings, ...), with the token windows they came from, on
their ``storage`` device (the compute device, or the host with ``calibration.offload``). It is the one place a
batch moves between host and device in a pass (``tests/test_activation_moves.py`` checks it):

- ``load``/``batches``: a batch onto the compute device. From the host to an accelerator the copy is
  ``non_blocking`` from page-locked (pinned) memory, which ``keep`` allocates: the device queues it and the host
  goes on (values and order are those of a plain ``.to``: the copy is exact).
- ``keep``: a layer's output back to ``storage`` (into pinned host memory when it comes from an accelerator).
- ``run``: one layer over the batches, the per-batch loop every layer run shares (``LayerPipeline.run_layer``,
  ``StagedLayer``, the original model's walk).

Prefetch: with host storage and a CUDA device, ``run`` and ``on`` load batch ``k + 1`` on a side copy stream
while batch ``k`` computes (:class:`CopyStream`); the compute stream waits for that copy before it reads the
batch. One more batch is then resident on the device. Elsewhere each batch is loaded when it is reached.

``replace(states)`` is the next layer's activations: new hidden states, the same keyword arguments and windows.
The store never changes a tensor in place; callers never do either.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from .tensors import hidden_state

#: ``meter(tensor, target)``: counts bytes that cross between host and device (``Timings.moved``).
Meter = Callable[[torch.Tensor, torch.device], None]


def _no_meter(_tensor: torch.Tensor, _target: torch.device) -> None:
    return None


class Activations:
    """Per calibration batch: hidden states ``states[k]``, the layers' keyword arguments ``kwargs[k]`` and the
    token window batch ``windows[k]``, kept on ``storage``. Iterating yields the hidden states (as stored)."""

    def __init__(self, states: list[torch.Tensor], kwargs: list[dict[str, Any]], windows: list[torch.Tensor],
                 storage: torch.device, meter: Meter = _no_meter):
        if not len(states) == len(kwargs) == len(windows):
            raise ValueError(f"activations: {len(states)} states, {len(kwargs)} keyword sets, "
                             f"{len(windows)} windows (one each per batch)")
        self.states, self.kwargs, self.windows = list(states), list(kwargs), list(windows)
        self.storage, self.meter = storage, meter

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.states)

    def __getitem__(self, k: int) -> torch.Tensor:
        return self.states[k]

    @property
    def tokens(self) -> int:
        """Token positions over all batches."""
        return sum(int(w.numel()) for w in self.windows)

    def replace(self, states: list[torch.Tensor]) -> "Activations":
        """The activations after a layer: ``states`` (one per batch), this store's keyword arguments and windows."""
        if len(states) != len(self):
            raise ValueError(f"activations: {len(states)} batches given, {len(self)} expected")
        return Activations(states, self.kwargs, self.windows, self.storage, self.meter)

    def copy(self, meter: Meter | None = None) -> "Activations":
        """New lists (and keyword dicts) around the same tensors: rebinding an entry leaves this store as it is.
        ``meter``: the copy's (a sweep variant reusing a capture counts its moves in its own timings log)."""
        return Activations(list(self.states), [dict(k) for k in self.kwargs], list(self.windows), self.storage,
                           self.meter if meter is None else meter)

    # -- moves --------------------------------------------------------------------------------------
    def keep(self, value: Any) -> Any:
        """``value`` (a tensor, or tuples, lists and dicts of them) on ``storage`` (a tensor already there:
        itself); into pinned host memory from an accelerator."""
        return keep(value, self.storage, self.meter)

    def load(self, value: Any, device: torch.device) -> Any:
        """``value`` (a tensor, or tuples, lists and dicts of them) on ``device``; from pinned host memory the
        copies are ``non_blocking``."""
        return load(value, device, self.meter)

    def batch(self, k: int, device: torch.device,
              kwargs_of: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> tuple[torch.Tensor, dict]:
        """Batch ``k`` on ``device``: its hidden states and its keyword arguments (``kwargs_of`` picks those a
        layer takes, e.g. ``ArchitectureAdapter.layer_kwargs``)."""
        kwargs = self.kwargs[k] if kwargs_of is None else kwargs_of(self.kwargs[k])
        return self.load(self.states[k], device), self.load(kwargs, device)

    def state(self, k: int, device: torch.device) -> torch.Tensor:
        """The hidden states of batch ``k`` on ``device``."""
        return self.load(self.states[k], device)

    def on(self, device: torch.device, indices: Iterable[int] | None = None) -> Iterator[torch.Tensor]:
        """The hidden states of the batches ``indices`` (all: in order) on ``device``, one at a time."""
        for _k, state in self.ahead(range(len(self)) if indices is None else indices, device,
                                    lambda k: self.state(k, device)):
            yield state

    def ahead(self, indices: Iterable[int], device: torch.device, fetch: Callable[[int], Any],
              copies: "CopyStream | None" = None) -> Iterator[tuple[int, Any]]:
        """``(k, fetch(k))`` for the batches ``indices``, in order, each fetched one batch ahead on a side copy
        stream when ``copies`` (default: :meth:`CopyStream.between` ``storage`` and ``device``) is given: batch
        ``k + 1``'s copy is issued before batch ``k`` is handed out, so it overlaps batch ``k``'s compute."""
        copies = CopyStream.between(self.storage, device) if copies is None else copies
        order = iter(indices)
        if copies is None:
            for k in order:
                yield k, fetch(k)
            return
        k = next(order, None)
        pending = None if k is None else (k, copies.issue(lambda: fetch(k)))
        while pending is not None:
            k, value = pending
            copies.ready(value)
            following = next(order, None)
            pending = None if following is None else (following, copies.issue(lambda: fetch(following)))
            yield k, value

    def windows_on(self, device: torch.device, indices: Iterable[int] | None = None) -> Iterator[torch.Tensor]:
        """The token windows of the batches ``indices`` (all: in order) on ``device``, one at a time."""
        for k in range(len(self)) if indices is None else indices:
            yield self.load(self.windows[k], device)

    # -- one layer over the batches -----------------------------------------------------------------
    def run(self, layer: nn.Module, device: torch.device, indices: Iterable[int] | None = None, *,
            kwargs_of: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
            before: Callable[[int, int], None] | None = None,
            after: Callable[[int, torch.Tensor], None] | None = None,
            stops: tuple[type[BaseException], ...] = (), copies: "CopyStream | None" = None) -> list[torch.Tensor]:
        """``layer`` over the batches ``indices`` (all, in order), each moved to ``device``; returns the outputs
        kept on ``storage``. ``before(position, k)`` runs before batch ``k`` (the ``position``-th run here),
        ``after(count, output)`` after it with the output on the device (``count``: outputs so far). A batch whose
        forward raises one of ``stops`` (a hook that stops it early) gives no output. ``copies``: see :meth:`ahead`."""
        outputs: list[torch.Tensor] = []
        batches = self.ahead(range(len(self)) if indices is None else indices, device,
                             lambda k: self.batch(k, device, kwargs_of), copies)
        for position, (k, (x, kwargs)) in enumerate(batches):
            if before is not None:
                before(position, k)
            try:
                out = hidden_state(layer(x, **kwargs))
            except stops:
                continue
            if after is not None:
                after(len(outputs), out)
            outputs.append(self.keep(out))
        return outputs


class CopyStream:
    """A side CUDA stream for host-to-device loads ahead of use. ``issue(fetch)`` runs ``fetch`` (its copies)
    on the side stream; ``ready(value)`` makes the compute stream wait for them and records the copied tensors
    on the compute stream, so that the caching allocator does not reuse their memory while compute still
    reads them (``Tensor.record_stream``)."""

    def __init__(self, device: torch.device):
        self.compute = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)

    @classmethod
    def between(cls, storage: torch.device, device: torch.device) -> "CopyStream | None":
        """A copy stream for loads from host ``storage`` onto a CUDA ``device``; None for any other pair."""
        return cls(device) if storage.type == "cpu" and device.type == "cuda" else None

    def issue(self, fetch: Callable[[], Any]) -> Any:
        with torch.cuda.stream(self.side):
            return fetch()

    def ready(self, value: Any) -> None:
        self.compute.wait_stream(self.side)

        def record(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.is_cuda:
                tensor.record_stream(self.compute)
            return tensor

        _each_tensor(value, record)


def keep(value: Any, storage: torch.device, meter: Meter = _no_meter) -> Any:
    """``value`` with every tensor in it (nested tuples, lists and dicts) on ``storage`` (a tensor already there:
    itself); an accelerator's tensor going to the host lands in pinned memory (an exact, blocking copy), so that
    loading it back can be ``non_blocking``."""
    def one(tensor: torch.Tensor) -> torch.Tensor:
        meter(tensor, storage)
        if storage.type == "cpu" and tensor.is_cuda:
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
            return pinned.copy_(tensor)
        return tensor.to(storage)

    return _each_tensor(value, one)


def load(value: Any, device: torch.device, meter: Meter = _no_meter) -> Any:
    """``value`` with every tensor in it (nested tuples, lists and dicts) on ``device``; pinned host tensors
    copy ``non_blocking`` (stream-ordered: the layer that reads them runs after the copy)."""
    def one(tensor: torch.Tensor) -> torch.Tensor:
        meter(tensor, device)
        return tensor.to(device, non_blocking=device.type == "cuda" and tensor.is_pinned())

    return _each_tensor(value, one)


def _each_tensor(value: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_each_tensor(v, move) for v in value)
    if isinstance(value, dict):
        return {k: _each_tensor(v, move) for k, v in value.items()}
    return value
