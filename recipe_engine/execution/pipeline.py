"""The layer-sequential pass: calibration activations and the layers that run over them.

Inputs of the first decoder layer are captured with recording stand-ins in place of the decoder layers (no
fx tracing) into an :class:`~recipe_engine.execution.activations.Activations` on the session's ``storage``
(the device, or the host with ``calibration.offload``); then decoder layers run one at a time over all
calibration batches, each run the store's per-batch loop (``Activations.run``: the only place a batch moves
between host and device), split over data-parallel ranks. This module keeps the pass state a resume
checkpoint saves. The original model's states beside the pass are
``recipe_engine.execution.reference_walk``'s, weight residency is ``recipe_engine.execution.residency``'s, the
steps are ``recipe_engine.execution.steps``'.

With ``propagate: compressed`` a layer's inputs come from the compressed layers before it, with ``original``
from the layers as they were."""
from __future__ import annotations

import time
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..architectures.adapters import LAYER_TYPE_KWARGS
from ..recipe.modifier import LayerModifier
from ..system.host_memory import trim_heap
from .activations import Activations, keep, load
from .distributed import module_digest
from .modifier_session import CurrentLayer
from .pass_state import PassState
from .reference_walk import ReferenceWalk
from .stats import Statistic, change_position
from .tensors import first_tensor, hidden_state

if TYPE_CHECKING:
    from .session import Session

PASS = "layer-sequential pass"


class _Captured(Exception):
    pass


class _Collected(Exception):
    """Raised after the last block a statistics-only run reads (``LayerPipeline.run_layer``'s ``stop_after``)."""


def _stop(*_args):
    raise _Collected


def last_block(hooks: list[Statistic]) -> str | None:
    """The block (``self_attn``, ``mlp``, ...) after whose forward every statistic in ``hooks`` has been fed,
    or None when one reads the whole layer (its module ``""``) or a module outside a block."""
    deepest = max(hooks, key=lambda stat: stat.position, default=None)
    if deepest is None or "." not in deepest.module or any(stat.position >= 4 for stat in hooks):
        return None
    return deepest.module.split(".")[0]


class _Capture:
    """What the recording stand-ins of ``LayerPipeline._capture`` collect: the first layer's hidden states and
    keyword arguments per batch (with several layer types, each type's first layer's own keyword arguments).
    Module-level, so a capture forms no reference cycle with the session (a dropped copy is freed at once)."""

    def __init__(self, storage: torch.device, types: list[str], count: int, meter):
        self.storage, self.types, self.count, self.meter = storage, types, count, meter
        self.by_type = len(set(types)) > 1
        self.inputs: list[torch.Tensor] = []
        self.kwargs: list[dict[str, Any]] = []

    def keep(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: keep(v, self.storage, self.meter) for k, v in kwargs.items()
                if k != "hidden_states" and k != "past_key_values"}

    def record(self, index: int, args: tuple, kwargs: dict) -> torch.Tensor:
        if index == 0:
            self.inputs.append(keep(first_tensor(args, kwargs), self.storage, self.meter))
            self.kwargs.append(self.keep(kwargs))
            if self.by_type:
                self.kwargs[-1][LAYER_TYPE_KWARGS] = {}
        if self.by_type and self.types[index] not in self.kwargs[-1][LAYER_TYPE_KWARGS]:
            self.kwargs[-1][LAYER_TYPE_KWARGS][self.types[index]] = self.keep(kwargs)
        if index == self.count - 1 or not self.by_type:
            raise _Captured
        return first_tensor(args, kwargs)


class _Recorder(nn.Module):
    """A decoder layer's stand-in during ``LayerPipeline._capture``: hands its inputs to the capture."""

    def __init__(self, index: int, capture: _Capture):
        super().__init__()
        self.index, self.capture = index, capture

    def forward(self, *args, **kwargs):
        return self.capture.record(self.index, args, kwargs)


class LayerPipeline:
    """The layer-sequential execution of one session (its model, calibration windows and residency, over the
    run's context). Its parts call one another directly; steps reach them through the session's view."""

    def __init__(self, session: "Session"):
        # a weak reference: no cycle with the session, so a dropped session (a BestOf branch's copy of the
        # model) is freed at once, without the cyclic collector
        self._session = weakref.ref(session)
        #: The layer ``run_layer_modifiers`` is compressing (``current_layer``) and what its step handed over.
        self.current: CurrentLayer | None = None
        self._provided: list[torch.Tensor] | None = None
        #: The original model's hidden states beside the pass (``original_outputs``, ``reference_outputs``),
        #: and, on a reference session, the states its ``as_received`` passes kept.
        self.walk = ReferenceWalk(session)

    @property
    def session(self) -> "Session":
        return self._session()

    # -- capture and layer runs -------------------------------------------------------------------
    def capture_inputs(self) -> Activations:
        """The activations entering decoder layer 0: hidden states and keyword arguments per batch (reused from
        the sweep memo when the embedding matrix is unchanged; callers never modify them in place). Starts a
        calibration pass (``passes.count()``)."""
        s = self.session
        ctx = s.context
        ctx.passes.count()
        embedding = ctx.adapter.embeddings(s.model).weight
        if s.memo is None or s.stream is not None or embedding.is_meta:
            return self._capture()
        return s.memo.capture(embedding, self._capture).copy(ctx.timings.moved)

    @torch.no_grad()
    def _capture(self) -> Activations:
        """The base model runs with its decoder layers swapped for recording stand-ins (no layer runs):
        the first records the hidden states and keyword arguments, and when layers differ in type
        (``config.layer_types``: Gemma 3's sliding / global attention masks and rotary embeddings) the first
        layer of each type records its own under ``LAYER_TYPE_KWARGS`` (``ArchitectureAdapter.layer_kwargs``)."""
        s = self.session
        ctx = s.context
        count, windows = len(s.layers), s.batches
        capture = _Capture(ctx.storage, list(getattr(s.model.config, "layer_types", None) or []), count,
                           ctx.timings.moved)
        layers = s.layers
        ctx.adapter.set_layer_list(s.model, nn.ModuleList([_Recorder(i, capture) for i in range(count)]))
        try:
            with s.residency.using(ctx.adapter.embeddings(s.model)), \
                    s.residency.on_device(ctx.adapter.rotary(s.model)), ctx.timings.phase("forward"):
                for batch in windows:
                    try:
                        s.model.model(input_ids=load(batch, ctx.device, ctx.timings.moved), use_cache=False)
                    except _Captured:
                        pass
        finally:
            ctx.adapter.set_layer_list(s.model, layers)
        return Activations(capture.inputs, capture.kwargs, windows, ctx.storage, ctx.timings.moved)

    @torch.no_grad()
    def run_layer(self, layer: nn.Module, inputs: Activations, hooks: list[Statistic] = (),
                  on_batch: Callable[[int, torch.Tensor], None] | None = None, *,
                  stop_after: str | None = None) -> Activations | None:
        """Run one (already placed) layer over all batches of ``inputs``, feeding ``hooks``; returns its outputs
        (the next layer's activations). ``on_batch(k, output)`` is called after batch ``k`` (its hooks have
        fired), output on the device. ``stop_after``: a block (``last_block(hooks)``) after whose forward each
        batch stops, for a run whose outputs are not needed (the statistics are those of a full run; None).

        Data-parallel (``session.parallel``): without ``on_batch`` each rank runs its share of the batches,
        the hooks' sums are all-reduced in fp64 and the outputs all-gathered (every rank returns all)."""
        s = self.session
        ctx = s.context
        split = ctx.parallel.split(len(inputs), shared=on_batch is None)
        handles = []
        for stat in hooks:
            module = layer.get_submodule(stat.module) if stat.module else layer

            def hook(_m, args, kwargs, output, stat=stat):
                stat.update(first_tensor(args, kwargs), hidden_state(output))

            handles.append(module.register_forward_hook(hook, with_kwargs=True))
        if stop_after is not None:  # registered after the statistics' hooks, which fire first
            handles.append(layer.get_submodule(stop_after).register_forward_hook(_stop))

        def before(_position: int, k: int) -> None:
            for stat in hooks:
                stat.batch = k
            s.work.count(batches=1)

        try:
            with ctx.timings.phase("forward"):
                outputs = inputs.run(layer, ctx.device, split.share, kwargs_of=partial(ctx.adapter.layer_kwargs, layer),
                                     before=before, after=on_batch, stops=(_Collected,))
        finally:
            for handle in handles:
                handle.remove()
        s.work.count(runs=1)
        split.reduce(hooks)
        if stop_after is None:
            outputs = split.gather(outputs)
        return None if stop_after is not None else inputs.replace(outputs)

    def layer_pass(self, visit: Callable[[int, Activations, Activations], None],
                   description: str = "calibration pass", skip: tuple[int, ...] = (), *, keep: bool = False) -> None:
        """Whole-model pass: ``visit(index, inputs, outputs)`` for every layer (skipped layers pass
        their inputs through unchanged and are not visited). ``keep``: the outputs after each layer are kept
        (``ReferenceWalk.start_keeping``; a reference session's pass for an ``as_received`` one, see
        ``ModifierView.layer_pass``)."""
        s, ctx = self.session, self.session.context
        inputs = self.capture_inputs()
        kept = self.walk.start_keeping() if keep else None
        for index in ctx.progress.track(range(len(s.layers)), description):
            if index in skip:
                continue
            with s.residency.using(index):
                outputs = self.run_layer(s.layers[index], inputs)
            visit(index, inputs, outputs)
            if kept is not None:
                kept.add(index + 1, outputs)
            inputs = outputs
            ctx.timings.record(**{"pass": description, "layer": index, "layers": len(s.layers)})

    # -- calibration loss --------------------------------------------------------------------------
    @torch.no_grad()
    def final_nll(self, finals: Activations, per_window: bool = False) -> float | list[float]:
        """Token-weighted mean next-token NLL of the calibration windows given the last decoder layer's
        outputs ``finals``: final norm, ``lm_head``, cross-entropy in fp32, summed per window in fp64.
        ``per_window``: each window's mean NLL, in window order. The ``lm_head`` product runs per batch; its
        logits go to fp32 and through the log-softmax one window at a time, so a batch of B windows holds its
        logits once in the model dtype and one window's twice in fp32, not B windows' three times (the
        same values: each window's rows are computed as in the batch)."""
        s = self.session
        ctx = s.context
        sums = torch.zeros(s.calibration.shape[0], dtype=torch.float64)
        norm, head = ctx.adapter.final_norm(s.model), ctx.adapter.lm_head(s.model)
        split = ctx.parallel.split(len(finals))
        ends = [0]
        for window in finals.windows:
            ends.append(ends[-1] + window.shape[0])  # each batch's windows
        own = split.own
        with s.residency.using(norm, head):
            for k, hidden, window in zip(own, finals.on(ctx.device, own), finals.windows_on(ctx.device, own)):
                logits = head(norm(hidden))
                rows = [torch.nn.functional.cross_entropy(logits[row:row + 1, :-1].float().transpose(1, 2),
                                                          window[row:row + 1, 1:], reduction="none").sum(dim=1)
                        for row in range(logits.shape[0])]
                del logits
                sums[ends[k]:ends[k + 1]] = torch.cat(rows).double().cpu()  # one host read per batch
        if split.share is not None:
            sums = torch.tensor(split.sum(sums.tolist()), dtype=torch.float64)
        tokens = s.calibration.shape[1] - 1
        if per_window:
            return (sums / tokens).tolist()
        return float(sums.sum()) / (tokens * len(sums))

    # -- outputs handed over by a step ------------------------------------------------------------
    def sum_over_ranks(self, batches: int, statistics: list) -> bool:
        """``CurrentLayer.sum_over_ranks``: all-reduce the statistics when the ranks split the ``batches``."""
        return self.session.context.parallel.split(batches).reduce(statistics)

    def provide_outputs(self, outputs: Activations) -> None:
        """``CurrentLayer.provide_outputs``: the layer's outputs on its inputs as the step leaves it."""
        if self.current is None:
            raise RuntimeError("provide_outputs() is only available inside compress_layer")
        if len(outputs) != len(self.current.inputs):
            raise ValueError(f"provide_outputs: {len(outputs)} batches given, {len(self.current.inputs)} expected")
        self._provided = outputs

    # -- layer-sequential compression ------------------------------------------------------------
    @torch.no_grad()
    def run_layer_modifiers(self, group: list[LayerModifier], checkpoints=None) -> dict[str, dict[str, Any]]:
        """One layer-sequential pass applying every modifier of ``group`` to its target layers.

        For each layer: collect the statistics the next modifier needs (reusing those still valid),
        compress, invalidate statistics downstream of what changed, then compute the layer's outputs
        as the next layer's inputs (from the compressed layer, or the original one with
        ``propagate: original``). Returns per-modifier reports keyed by ``"{step index}"``; each has
        ``own_s``, the wall time of that modifier's own work (its statistics forwards, compression and
        ``finish``), the rest of the pass (loading, shared forwards) being shared. ``checkpoints``
        (``recipe_engine.execution.resume.Checkpoints``, or None): a resumed pass starts after its last
        finished layer, and every finished layer is checkpointed.
        """
        s = self.session
        ctx = s.context
        view = s.view  # held here: the pass's steps see one view, which the session keeps weakly
        own = [0.0] * len(group)
        state = self._start(group, checkpoints)
        last = max((max(t) for t in state.targets if t), default=-1)
        for index in ctx.progress.track(range(state.next_layer, last + 1), PASS):
            active = [k for k, t in enumerate(state.targets) if index in t]
            with s.residency.using(index):
                if not active:
                    state.inputs = self.run_layer(s.layers[index], state.inputs)
                    self._layer_done(state, index, last, checkpoints)
                    continue
                state.inputs = self._compress_layer(group, active, index, state, own)
            self._layer_done(state, index, last, checkpoints)
        self.walk.states = None
        for k, modifier in enumerate(group):
            started = time.perf_counter()
            state.reports[k].update(modifier.finish(view))
            state.reports[k]["own_s"] = own[k] + time.perf_counter() - started
        return {str(k): r for k, r in enumerate(state.reports)}

    def _start(self, group: list[LayerModifier], checkpoints) -> PassState:
        """The pass's state before its first layer: fresh, or where a checkpoint left it (``--resume``: its saved
        activations with the keyword arguments captured now, and the original model's states likewise)."""
        s = self.session
        inputs = self.capture_inputs()
        resumed = None if checkpoints is None else checkpoints.pass_state(
            inputs, lambda: s.reference_session().pipeline.capture_inputs())
        self.walk.states = None
        if resumed is None:
            return PassState(0, inputs, [{"layers": {}} for _ in group], [set(m.target_layers(s.view)) for m in group])
        self.walk.states = resumed.reference
        return resumed

    def _layer_done(self, state: PassState, index: int, last: int, checkpoints) -> None:
        state.next_layer, state.reference = index + 1, self.walk.states
        if self.session.stream is None:  # a streamed layer's release gives them back already (``WeightStream.loaded``)
            trim_heap()  # the layer's statistics, solves and replaced weights are freed: give their pages back
        if checkpoints is not None:
            checkpoints.layer_done(self.session, index, state)
        self.session.context.timings.record(**{"pass": PASS, "layer": index, "layers": last + 1})

    def _compress_layer(self, group: list[LayerModifier], active: list[int], index: int, state: PassState,
                        own: list[float]) -> Activations:
        """Every active modifier on layer ``index`` (placed), in recipe order; returns the layer's outputs,
        the next layer's inputs. Statistics are collected by the forwards the modifiers need and reused
        until a modifier changes what they read (``change_position``)."""
        s = self.session
        ctx = s.context
        layer, inputs = s.layers[index], state.inputs
        keep_original = ctx.config.propagate == "original"
        original_outputs = provided = None
        cache: dict[str, Statistic] = {}
        for k in active:
            modifier, started = group[k], time.perf_counter()
            ctx.timings.split("shared")
            needed = modifier.statistics(s.view, index)
            missing = [stat for stat in needed if stat.key not in cache]
            if keep_original and original_outputs is None:  # the unchanged layer's outputs go on
                original_outputs = self.run_layer(layer, inputs, hooks=missing)
            elif missing:  # statistics only: each forward stops after the last block they read
                self.run_layer(layer, inputs, hooks=missing, stop_after=last_block(missing))
            cache.update({stat.key: stat for stat in missing})
            self.current, self._provided = CurrentLayer(inputs, self.provide_outputs,
                                                        partial(self.sum_over_ranks, len(inputs))), None
            try:
                with ctx.timings.phase("compress"):
                    entry = modifier.compress_layer(s.view, index, {stat.key: cache[stat.key] for stat in needed})
                provided = self._provided
            finally:
                self.current = self._provided = None
            state.reports[k]["layers"][str(index)] = entry
            changed = min((change_position(m) for m in modifier.modifies), default=99)
            cache = {key: stat for key, stat in cache.items() if stat.position <= changed and not stat.released}
            own[k] += time.perf_counter() - started
            ctx.timings.split(modifier.step_name())
        if ctx.parallel.active:  # the guard: every rank compressed this layer alike
            entries = [r["layers"].get(str(index)) for r in state.reports]
            ctx.parallel.agree(f"layer {index}", module_digest(s.layers[index], entries))
        if keep_original:
            return original_outputs
        if provided is not None:
            return provided
        return self.run_layer(s.layers[index], inputs)
