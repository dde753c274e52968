"""Weight residency: which weights are materialized, and where, while a session runs.

An in-memory model's modules are moved to the session device for a block and back (``on_device``); a
streamed model's units are materialized from disk for a block and released after, staging what changed
(``recipe_engine.execution.streaming``). Entering a block counts as ``load`` and leaving it as ``write`` in
the run's timings log.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from .streaming import stream_units

if TYPE_CHECKING:
    from .session import Session


class Residency:
    """The weight residency of one session (its model, stream, device and timings, read at each call)."""

    def __init__(self, session: "Session"):
        # a weak reference: no cycle with the session, so a dropped session (a BestOf branch's copy of the
        # model) is freed at once, without the cyclic collector
        self._session = weakref.ref(session)

    @property
    def session(self) -> "Session":
        return self._session()

    def _modules(self, items) -> list[nn.Module]:
        layers = self.session.layers
        return [layers[i] if isinstance(i, int) else i for i in items]

    def units_of(self, items) -> list[nn.Module]:
        """Streamed units behind ``items``: a tied ``lm_head`` is the embeddings' unit; each unit once."""
        s = self.session
        embeddings, head = s.context.adapter.embeddings(s.model), s.context.adapter.lm_head(s.model)
        units = [embeddings if m is head and head.weight is embeddings.weight else m
                 for m in self._modules(items)]
        return list({id(m): m for m in units}.values())

    def loaded(self, *items: int | nn.Module) -> contextlib.AbstractContextManager:
        """Weights of these layers (current indices) or modules materialized on CPU for the block; on
        exit a streamed model stages what changed and releases it. A no-op for an in-memory model."""
        if self.session.stream is None:
            return contextlib.nullcontext()
        return self._timed(self.session.stream.loaded(self.units_of(items), torch.device("cpu")))

    def using(self, *items: int | nn.Module) -> contextlib.AbstractContextManager:
        """Layers (current indices) or modules with real weights on the session device for the block:
        materialized there from disk when streamed, else moved there and back (``on_device``)."""
        s = self.session
        if s.stream is None:
            return self.on_device(*self._modules(items))
        after = max((i for i in items if isinstance(i, int)), default=None)
        following = s.layers[after + 1] if after is not None and after + 1 < len(s.layers) else None
        return self._reading_ahead(self._timed(s.stream.loaded(self.units_of(items), s.context.device)), following)

    @contextlib.contextmanager
    def _reading_ahead(self, block: contextlib.AbstractContextManager, following: nn.Module | None) -> Iterator[None]:
        """``block``; once its layers are loaded, the layer after them is read from disk while the block
        computes (a pass goes on to it next: ``WeightStream.read_ahead``)."""
        with block:
            if following is not None:
                self.session.stream.read_ahead(following, self.session.context.device)
            yield

    @contextlib.contextmanager
    def _timed(self, block: contextlib.AbstractContextManager) -> Iterator[None]:
        """``block`` with its entry timed as ``load`` and its exit as ``write`` (``timings``)."""
        timings = self.session.context.timings
        stack = contextlib.ExitStack()
        with timings.phase("load"):
            stack.enter_context(block)
        try:
            yield
        except BaseException:
            if not stack.__exit__(*sys.exc_info()):
                raise
            return
        with timings.phase("write"):
            stack.close()

    def stream_units(self) -> list[nn.Module]:
        """What a streamed model loads and releases whole (``streaming.stream_units``)."""
        return stream_units(self.session.model, self.session.context.adapter)

    def resident(self) -> contextlib.AbstractContextManager:
        """The whole model materialized on CPU for the block (for steps that need every weight at once,
        e.g. training); a no-op for an in-memory model."""
        return self.loaded(*self.stream_units())

    @contextlib.contextmanager
    def on_device(self, *modules: nn.Module) -> Iterator[None]:
        """Move modules to the session device for the duration of the block, then back where each was (a
        module already on the device, e.g. the layer a pass is using, stays there)."""
        device, timings = self.session.context.device, self.session.context.timings
        if device.type == "cpu":
            yield
            return
        homes = [next(itertools.chain(module.parameters(), module.buffers()), torch.empty(0)).device
                 for module in modules]
        with timings.phase("load"):
            for module in modules:
                module.to(device)
        try:
            yield
        finally:
            with timings.phase("write"):
                for module, home in zip(modules, homes):
                    module.to(home)
