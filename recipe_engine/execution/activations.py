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
- ``gather``: the outputs of a data-parallel rank's share, all-gathered in batch order.

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
        for k in range(len(self)) if indices is None else indices:
            yield self.state(k, device)

    def windows_on(self, device: torch.device, indices: Iterable[int] | None = None) -> Iterator[torch.Tensor]:
        """The token windows of the batches ``indices`` (all: in order) on ``device``, one at a time."""
        for k in range(len(self)) if indices is None else indices:
            yield self.load(self.windows[k], device)

    # -- one layer over the batches -----------------------------------------------------------------
    def run(self, layer: nn.Module, device: torch.device, indices: Iterable[int] | None = None, *,
            kwargs_of: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
            before: Callable[[int, int], None] | None = None,
            after: Callable[[int, torch.Tensor], None] | None = None,
            stops: tuple[type[BaseException], ...] = ()) -> list[torch.Tensor]:
        """``layer`` over the batches ``indices`` (all, in order), each moved to ``device``; returns the outputs
        kept on ``storage``. ``before(position, k)`` runs before batch ``k`` (the ``position``-th run here),
        ``after(count, output)`` after it with the output on the device (``count``: outputs so far). A batch whose
        forward raises one of ``stops`` (a hook that stops it early) gives no output."""
        outputs: list[torch.Tensor] = []
        for position, k in enumerate(range(len(self)) if indices is None else indices):
            if before is not None:
                before(position, k)
            x, kwargs = self.batch(k, device, kwargs_of)
            try:
                out = hidden_state(layer(x, **kwargs))
            except stops:
                continue
            if after is not None:
                after(len(outputs), out)
            outputs.append(self.keep(out))
        return outputs

    def gather(self, parallel, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every data-parallel rank's ``local`` outputs (its ``parallel.share(len(self))``), in batch order."""
        return parallel.gather(local, len(self))


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
