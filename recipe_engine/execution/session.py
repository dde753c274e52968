"""The shared calibration session: layer-sequential execution over one set of calibration tokens.

Inputs of the first decoder layer are captured with a forward pre-hook (no fx tracing); then decoder layers
run one at a time over all calibration batches. Only the layer in use sits on the accelerator; activations
live on CPU between layers when ``offload`` is true, so peak accelerator memory is about one layer plus one
layer's activations. With ``propagate: compressed`` a layer's inputs come from the already-compressed layers
before it; with ``original`` from the layers as they were when the pass started.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import tempfile
import time
from copy import deepcopy
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..architectures.adapters import LAYER_TYPE_KWARGS, ArchitectureAdapter
from ..architectures.shape import WIDTH_INDEX, LayerShape, ModelShape, WidthPart
from ..recipe.modifier import LayerModifier, Modifier
from ..recipe.schema import CalibrationConfig
from ..system.progress import Progress
from .distributed import Parallel, module_digest
from .memo import SharedWork
from .modifier_session import CurrentLayer, PassCounter
from .outputs import RunOutputs
from .stats import Statistic, change_position
from .steps import run_steps
from .streaming import WeightStream, stream_units
from .timings import Timings


class _Captured(Exception):
    pass


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class _Capture:
    """What the recording stand-ins of ``Session._capture_inputs`` collect: the first layer's hidden states and
    keyword arguments per batch, and with several layer types the first layer of each type's own keyword
    arguments. Module-level (not a class made per call) so that a capture forms no reference cycle with the
    session: a copied model is freed as soon as its session is dropped, without the cyclic collector."""

    def __init__(self, storage: torch.device, types: list[str], count: int):
        self.storage, self.types, self.count = storage, types, count
        self.by_type = len(set(types)) > 1
        self.inputs: list[torch.Tensor] = []
        self.kwargs_list: list[dict[str, Any]] = []

    def keep(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: to_device(v, self.storage) for k, v in kwargs.items()
                if k != "hidden_states" and k != "past_key_values"}

    def record(self, index: int, args: tuple, kwargs: dict) -> torch.Tensor:
        if index == 0:
            self.inputs.append(_first_tensor(args, kwargs).to(self.storage))
            self.kwargs_list.append(self.keep(kwargs))
            if self.by_type:
                self.kwargs_list[-1][LAYER_TYPE_KWARGS] = {}
        if self.by_type and self.types[index] not in self.kwargs_list[-1][LAYER_TYPE_KWARGS]:
            self.kwargs_list[-1][LAYER_TYPE_KWARGS][self.types[index]] = self.keep(kwargs)
        if index == self.count - 1 or not self.by_type:
            raise _Captured
        return _first_tensor(args, kwargs)


class _Recorder(nn.Module):
    """A decoder layer's stand-in during ``Session._capture_inputs``: hands its inputs to the capture."""

    def __init__(self, index: int, capture: _Capture):
        super().__init__()
        self.index, self.capture = index, capture

    def forward(self, *args, **kwargs):
        return self.capture.record(self.index, args, kwargs)


def hidden_state(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def remove_layers(session, remove: list[int]) -> list[tuple[int, ...]]:
    """Drop the current layers in ``remove`` from a session (``ModifierSession.set_layers``); returns the
    original indices of what was dropped."""
    keep = [i for i in range(len(session.layers)) if i not in set(remove)]
    dropped = [session.layer_origin[i] for i in sorted(remove)]
    session.set_layers([session.layers[i] for i in keep], [session.layer_origin[i] for i in keep], keep)
    return dropped


class Session:
    """Explicit state of one recipe run; passed to every modifier (no globals). Modifiers see it through
    :class:`~recipe_engine.execution.modifier_session.ModifierSession`; the rest is the engine's.

    The engine-side collaborators are the runner's, handed over here: ``stream`` (residency of a streamed
    model, ``recipe_engine.execution.streaming``), ``parallel`` (data-parallel ranks), ``memo`` (work shared
    by a sweep's variants), ``outputs`` (the extras collector) and ``passes`` (the pass counter); resume
    checkpoints are passed to the pass that writes them (``run_layer_modifiers``).
    """

    def __init__(self, model: nn.Module, tokenizer, adapter: ArchitectureAdapter,
                 calibration: torch.Tensor, config: CalibrationConfig, device: torch.device,
                 progress: Progress | None = None,
                 reference_loader: Callable[[], "nn.Module | Session"] | None = None,
                 stream: WeightStream | None = None, parallel: Parallel | None = None,
                 passes: PassCounter | None = None, *, memo: SharedWork | None = None,
                 outputs: RunOutputs | None = None, origin: list[tuple[int, ...]] | None = None,
                 original_layers: int | None = None, completed: list[str] = ()):
        self.model, self.tokenizer, self.adapter = model, tokenizer, adapter
        #: Calibration passes made so far by this session and its siblings (``recipe plan`` predicts them).
        self.passes = passes or PassCounter()
        #: This process's rank in a data-parallel run (``recipe_engine.execution.distributed``); one process: a no-op.
        self.parallel = parallel or Parallel(device=device)
        #: Set when the model is a meta-device skeleton streamed from disk (``recipe_engine.execution.streaming``).
        self.stream = stream
        self.calibration, self.config, self.device = calibration, config, device
        self.progress = progress or Progress(enabled=False)
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layer_origin: list[tuple[int, ...]] = (list(origin) if origin is not None
                                                    else [(i,) for i in range(cfg.num_hidden_layers)])
        #: Decoder layers of the model the run started from (``layer_origin`` indexes into them).
        self.original_layers = original_layers if original_layers is not None else cfg.num_hidden_layers
        #: Extras, artifacts and quantization records the steps produce (``recipe_engine.execution.outputs``).
        self.outputs = outputs if outputs is not None else RunOutputs()
        #: Layer runs over the calibration batches (``run_layer``, staged layers) by this session.
        self.layer_runs = 0
        #: Calibration batches this process ran through (part of) a layer (a data-parallel rank: its share).
        self.layer_batches = 0
        self._reference_loader = reference_loader
        self._reference: Session | None = None
        #: The layer being compressed by ``run_layer_modifiers`` (see ``current_layer``).
        self._current: CurrentLayer | None = None
        #: Outputs of that layer handed over by the step compressing it (``CurrentLayer.provide_outputs``).
        self._provided: list[torch.Tensor] | None = None
        #: Original model's hidden states in lockstep with a pass: (next original layer, states, kwargs).
        self._reference_stream: tuple[int, list[torch.Tensor], list[dict[str, Any]]] | None = None
        #: Work shared across a sweep's variants (``recipe_engine.execution.memo``), None in a plain run; the
        #: canonical parameters of the steps completed so far (``mark_completed``) key it.
        self.memo = memo
        self.completed_steps: list[str] = list(completed)
        #: Report records of the steps this session ran (``run_steps``; a branch's, see ``branch``).
        self.records: list[dict[str, Any]] = []
        #: The run's phase clock and timings log (``recipe_engine.execution.timings``), shared by siblings.
        self.timings = Timings()

    # -- facts ---------------------------------------------------------------------------------
    @property
    def streamed(self) -> bool:
        """The model is a meta-device skeleton whose weights stream from disk."""
        return self.stream is not None

    @property
    def shape(self) -> ModelShape:
        """The symbolic shape of the model as it is now (widths read from the weights, ``layer_origin``),
        for checking steps against the model mid-run."""
        return self.current_shape()

    @property
    def reference(self) -> "Session":
        """The original model's session (``reference_session``)."""
        return self.reference_session()

    @property
    def current_layer(self) -> CurrentLayer:
        """The layer ``run_layer_modifiers`` is compressing: its inputs and the outputs hand-over (valid
        inside ``compress_layer`` only)."""
        if self._current is None:
            raise RuntimeError("current_layer is only available inside compress_layer")
        return self._current

    def mark_completed(self, steps: list[str]) -> None:
        """Record the canonical parameters of steps just completed (they key the sweep memo)."""
        self.completed_steps += steps

    def count_layer_work(self, runs: int = 0, batches: int = 0) -> None:
        """Count layer runs and calibration batches run through a layer (``StagedLayer`` runs its own)."""
        self.layer_runs += runs
        self.layer_batches += batches

    # -- structure ---------------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return self.adapter.layers(self.model)

    def set_layers(self, layers: list[nn.Module], origin: list[tuple[int, ...]],
                   inherit: list[int]) -> None:
        """Replace the decoder layers; ``origin`` gives the original indices each new layer covers,
        ``inherit`` the current index whose per-layer config entries it keeps."""
        self.adapter.set_layers(self.model, layers, inherit)
        self.layer_origin = list(origin)

    def oversized_layers(self, part: WidthPart | None = None) -> list[int]:
        """Layers wider than the config, read from the weights: in query heads (``part="attention"``),
        in intermediate size (``"mlp"``), or in either (``None``, which also compares KV heads)."""
        cfg = self.model.config
        standard = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
        picked = WIDTH_INDEX[part]
        return [i for i, layer in enumerate(self.layers)
                if [self.adapter.layer_widths(layer, self.head_dim)[k] for k in picked]
                != [standard[k] for k in picked]]

    def reference_session(self) -> "Session":
        """A session over the original, unmodified model with the same calibration tokens, for steps that
        compare against the original: a read-only skeleton streamed layer by layer from the source
        checkpoint (or, for a model passed in memory, a CPU copy taken before the first step)."""
        if self._reference is None:
            if self._reference_loader is None:
                raise RuntimeError("this session has no reference model loader")
            reference = self._reference_loader()
            self._reference = reference if isinstance(reference, Session) else self.sibling(reference, None)
        return self._reference

    def sibling(self, model: nn.Module, stream: WeightStream | None, calibration: torch.Tensor | None = None,
                **state) -> "Session":
        """A session sharing this one's tokenizer, adapter, calibration settings and device (``state``: the
        keyword arguments of ``Session``: memo, origin, ...)."""
        session = Session(model, self.tokenizer, self.adapter,
                          self.calibration if calibration is None else calibration, self.config, self.device,
                          self.progress, stream=stream, parallel=self.parallel, passes=self.passes, **state)
        session.timings = self.timings
        return session

    # -- branches: alternatives run side by side (a step choosing between them) -------------
    def current_shape(self) -> ModelShape:
        """The symbolic shape of the model as it is now (widths read from the weights, ``layer_origin``),
        for checking steps against the model mid-run."""
        shape = ModelShape.from_config(self.model.config)
        shape.original_layers = self.original_layers
        shape.layers = [LayerShape(*self.adapter.layer_widths(layer, self.head_dim)[:3], tuple(origin))
                        for layer, origin in zip(self.layers, self.layer_origin)]
        shape.streamed = self.stream is not None
        return shape

    def branch(self, calibration: torch.Tensor, steps: list[Modifier] = (), *, copy: bool = True,
               memo: SharedWork | None = None) -> "Session":
        """A session calibrated on ``calibration`` sharing the pass counter, device and progress; ``memo``
        (a ``SharedWork``) shares work between sessions over the same windows.

        ``copy=True``: over a CPU copy of the model as it is now, which runs ``steps`` as a recipe would
        (consecutive layer steps share a pass; their report records in ``records``; no resume checkpoints):
        this session is untouched until :meth:`adopt`. Its reference model is this session's, over the same
        ``calibration`` windows. In-memory models only (a streamed model has no second copy to branch into).
        ``copy=False``: over this very model (streamed or not), e.g. to score it on other windows."""
        if not copy:
            if steps:
                raise ValueError("branch(copy=False) runs no steps (they would change this session's model)")
            return self.sibling(self.model, self.stream, calibration, memo=memo, origin=self.layer_origin,
                                original_layers=self.original_layers)
        if self.stream is not None:
            raise RuntimeError("a streamed session cannot branch (its weights live in one staged copy)")
        reference_loader = None
        if self._reference_loader is not None or self._reference is not None:
            reference_loader = lambda: (lambda ref: ref.sibling(ref.model, ref.stream, calibration))(
                self.reference_session())
        copies: dict[int, Any] = {}  # deepcopy's memo: each original object → its copy
        model = deepcopy(self.model, copies).to("cpu")
        branch = self.sibling(model, None, calibration, memo=memo,
                              origin=self.layer_origin, original_layers=self.original_layers,
                              completed=self.completed_steps, reference_loader=reference_loader,
                              outputs=self.outputs.copy_for(copies))
        if steps:
            branch.run_steps(list(steps))
        return branch

    def run_steps(self, steps: list[Modifier]) -> list[dict[str, Any]]:
        """Run recipe steps on this session as a recipe would (consecutive layer steps share a pass);
        returns their report records (also kept in ``records``; no resume checkpoints)."""
        self.records = run_steps(self, list(steps), self.progress)
        return self.records

    def adopt(self, branch: "Session") -> None:
        """Make this session's model the branch's: its modules (with any hooks on them), config, layer
        origins, extras, artifacts and quantization records move over; the model object stays the same."""
        for name, child in list(branch.model.named_children()):
            setattr(self.model, name, child)
        self.model.config = branch.model.config
        self.layer_origin = list(branch.layer_origin)
        self.outputs.adopt(branch.outputs)
        self.count_layer_work(branch.layer_runs, branch.layer_batches)

    # -- execution primitives ----------------------------------------------------------------
    @property
    def storage(self) -> torch.device:
        return torch.device("cpu") if self.config.offload else self.device

    @property
    def batches(self) -> list[torch.Tensor]:
        """The calibration windows in batches of ``config.batch_size``."""
        return list(self.calibration.split(self.config.batch_size))

    def map(self, function: Callable[[Any], Any], items: list) -> list:
        """``[function(x) for x in items]``; a data-parallel run spreads the items over the ranks and gathers
        the results, so every rank gets the same list (for independent solves, e.g. candidate subsets)."""
        return self.parallel.map(function, list(items))

    def _modules(self, items) -> list[nn.Module]:
        return [self.layers[i] if isinstance(i, int) else i for i in items]

    def units_of(self, items) -> list[nn.Module]:
        """Streamed units behind ``items``: a tied ``lm_head`` is the embeddings' unit; each unit once."""
        embeddings, head = self.adapter.embeddings(self.model), self.adapter.lm_head(self.model)
        units = [embeddings if m is head and head.weight is embeddings.weight else m
                 for m in self._modules(items)]
        return list({id(m): m for m in units}.values())

    def loaded(self, *items: int | nn.Module) -> contextlib.AbstractContextManager:
        """Weights of these layers (current indices) or modules materialized on CPU for the block; on
        exit a streamed model stages what changed and releases it. A no-op for an in-memory model."""
        if self.stream is None:
            return contextlib.nullcontext()
        return self._timed(self.stream.loaded(self.units_of(items), torch.device("cpu")))

    def using(self, *items: int | nn.Module) -> contextlib.AbstractContextManager:
        """Layers (current indices) or modules with real weights on the session device for the block:
        materialized there from disk when streamed, else moved there and back (``on_device``)."""
        if self.stream is None:
            return self.on_device(*self._modules(items))
        return self._timed(self.stream.loaded(self.units_of(items), self.device))

    @contextlib.contextmanager
    def _timed(self, block: contextlib.AbstractContextManager) -> Iterator[None]:
        """``block`` with its entry timed as ``load`` and its exit as ``write`` (``timings``)."""
        stack = contextlib.ExitStack()
        with self.timings.phase("load"):
            stack.enter_context(block)
        try:
            yield
        except BaseException:
            if not stack.__exit__(*sys.exc_info()):
                raise
            return
        with self.timings.phase("write"):
            stack.close()

    def placed(self, *items: int | nn.Module, on_device: bool = True) -> contextlib.AbstractContextManager:
        """The protocol's residency block. ``on_device``: layers named by current index are the model's own
        (``using``: read from disk onto the device when streamed, else moved there and back); modules given
        as objects are moved to the device and back (``on_device``: a module a step built, another model, a
        layer the block already holds). ``on_device=False``: layers or model parts (embeddings, final norm,
        ``lm_head``) materialized in host memory for the block (``loaded``; a no-op in memory)."""
        if not on_device:
            return self.loaded(*items)
        indices = [item for item in items if isinstance(item, int)]
        modules = [item for item in items if not isinstance(item, int)]
        if not modules:
            return self.using(*indices)
        if not indices:
            return self.on_device(*modules)
        block = contextlib.ExitStack()
        block.enter_context(self.using(*indices))
        block.enter_context(self.on_device(*modules))
        return block

    def release(self, module: nn.Module) -> None:
        """Stage a module built by a step (e.g. a merged layer) and free its weights (streamed models)."""
        if self.stream is not None:
            self.stream.release(module)

    @property
    def scratch_directory(self) -> Path | None:
        """Where a step of a streamed run may spill large working data to disk (the staging directory,
        inside the output's temporary directory, so it goes with it; a temporary directory for a read-only
        stream); ``None`` for an in-memory model (keep it in memory)."""
        if self.stream is None:
            return None
        if self.stream.staging is None:
            return Path(tempfile.gettempdir())
        self.stream.staging.mkdir(parents=True, exist_ok=True)
        return self.stream.staging

    def stream_units(self) -> list[nn.Module]:
        """What a streamed model loads and releases whole (``streaming.stream_units``)."""
        return stream_units(self.model, self.adapter)

    def resident(self) -> contextlib.AbstractContextManager:
        """The whole model materialized on CPU for the block (for steps that need every weight at once,
        e.g. training); a no-op for an in-memory model."""
        return self.loaded(*self.stream_units())

    @contextlib.contextmanager
    def on_device(self, *modules: nn.Module) -> Iterator[None]:
        """Move modules to the session device for the duration of the block, then back where each was (a
        module already on the device, e.g. the layer a pass is using, stays there)."""
        if self.device.type == "cpu":
            yield
            return
        homes = [next(itertools.chain(module.parameters(), module.buffers()), torch.empty(0)).device
                 for module in modules]
        with self.timings.phase("load"):
            for module in modules:
                module.to(self.device)
        try:
            yield
        finally:
            with self.timings.phase("write"):
                for module, home in zip(modules, homes):
                    module.to(home)

    def shared(self, step, label: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, or its value from an earlier sweep variant in the same state (``memo``)."""
        return compute() if self.memo is None else self.memo.step_value(step, self.completed_steps, label, compute)

    def capture_inputs(self) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """Hidden states and keyword arguments entering decoder layer 0, one entry per batch (reused from
        the sweep memo when the embedding matrix is unchanged; callers never modify them in place).
        Starts a calibration pass (``passes.count()``)."""
        self.passes.count()
        embedding = self.adapter.embeddings(self.model).weight
        if self.memo is None or self.stream is not None or embedding.is_meta:
            return self._capture_inputs()
        return self.memo.capture(embedding, self._capture_inputs)


    @torch.no_grad()
    def _capture_inputs(self) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """The base model runs with its decoder layers swapped for recording stand-ins (no layer runs):
        the first records the hidden states and keyword arguments, and when layers differ in type
        (``config.layer_types``: Gemma 3's sliding / global attention masks and rotary embeddings) the first
        layer of each type records its own under ``LAYER_TYPE_KWARGS`` (``ArchitectureAdapter.layer_kwargs``)."""
        count = len(self.layers)
        capture = _Capture(self.storage, list(getattr(self.model.config, "layer_types", None) or []), count)
        layers = self.layers
        base = self.model.model
        self.adapter.set_layer_list(self.model, nn.ModuleList([_Recorder(i, capture) for i in range(count)]))
        try:
            with self.using(self.adapter.embeddings(self.model)), self.on_device(self.adapter.rotary(self.model)), \
                    self.timings.phase("forward"):
                for batch in self.batches:
                    try:
                        base(input_ids=batch.to(self.device), use_cache=False)
                    except _Captured:
                        pass
        finally:
            self.adapter.set_layer_list(self.model, layers)
        return capture.inputs, capture.kwargs_list

    @torch.no_grad()
    def run_layer(self, layer: nn.Module, inputs: list[torch.Tensor], kwargs_list: list[dict[str, Any]],
                  hooks: list[Statistic] = (),
                  on_batch: Callable[[int, torch.Tensor], None] | None = None) -> list[torch.Tensor]:
        """Run one (already placed) layer over all batches, feeding ``hooks``; returns its outputs.
        ``on_batch(k, output)`` is called after batch ``k`` (its hooks have fired), output on the device.

        Data-parallel (``self.parallel``): without ``on_batch`` each rank runs its share of the batches,
        the hooks' sums are all-reduced in fp64 and the outputs all-gathered (every rank returns all)."""
        share = self.parallel.share(len(inputs)) if on_batch is None else None
        handles = []
        for stat in hooks:
            module = layer.get_submodule(stat.module) if stat.module else layer

            def hook(_m, args, kwargs, output, stat=stat):
                stat.update(_first_tensor(args, kwargs), hidden_state(output))

            handles.append(module.register_forward_hook(hook, with_kwargs=True))
        outputs = []
        try:
            with self.timings.phase("forward"):
                for k, (x, kwargs) in enumerate(zip(inputs, kwargs_list)):
                    if share is not None and k not in share:
                        continue
                    for stat in hooks:
                        stat.batch = k
                    self.timings.moved(x, self.device)
                    out = hidden_state(layer(x.to(self.device),
                                             **to_device(self.adapter.layer_kwargs(layer, kwargs), self.device)))
                    self.count_layer_work(batches=1)
                    if on_batch is not None:
                        on_batch(len(outputs), out)
                    self.timings.moved(out, self.storage)
                    outputs.append(out.to(self.storage))
        finally:
            for handle in handles:
                handle.remove()
        self.count_layer_work(runs=1)
        if share is not None:
            self.parallel.reduce_statistics(hooks)
            outputs = self.parallel.gather(outputs, len(inputs))
        return outputs

    def layer_pass(self, visit: Callable[[int, list[torch.Tensor], list[torch.Tensor]], None],
                   description: str = "calibration pass", skip: tuple[int, ...] = ()) -> None:
        """Whole-model pass: ``visit(index, inputs, outputs)`` for every layer (skipped layers pass
        their inputs through unchanged and are not visited)."""
        inputs, kwargs_list = self.capture_inputs()
        for index in self.progress.track(range(len(self.layers)), description):
            if index in skip:
                continue
            with self.using(index):
                outputs = self.run_layer(self.layers[index], inputs, kwargs_list)
            visit(index, inputs, outputs)
            inputs = outputs
            self.timings.record(**{"pass": description, "layer": index, "layers": len(self.layers)})

    @torch.no_grad()
    def calibration_nll(self, skip: tuple[int, ...] = (), finals: list[torch.Tensor] | None = None,
                        per_window: bool = False) -> float | list[float]:
        """Token-weighted mean next-token NLL of the calibration windows (layers in ``skip`` bypassed;
        at least one layer must run). With ``finals``, the last decoder layer's outputs (one tensor per
        batch, e.g. of a model assembled by the step), no pass is made: see ``final_nll``. ``per_window``:
        each window's mean NLL instead, in window order (windows are equally long: their mean is the former)."""
        if finals is not None:
            if skip:
                raise ValueError("calibration_nll: skip and finals exclude each other")
            return self.final_nll(finals, per_window)
        finals = []

        def keep_last(index: int, _inputs, outputs) -> None:
            finals[:] = outputs

        self.layer_pass(keep_last, "calibration NLL", skip=skip)
        return self.final_nll(finals, per_window)

    @torch.no_grad()
    def final_nll(self, finals: list[torch.Tensor], per_window: bool = False) -> float | list[float]:
        """Token-weighted mean next-token NLL of the calibration windows given the last decoder layer's
        outputs ``finals`` (one tensor per batch): final norm, ``lm_head``, cross-entropy in fp32, summed per
        window in fp64. ``per_window``: each window's mean NLL, in window order."""
        sums = torch.zeros(self.calibration.shape[0], dtype=torch.float64)
        norm, head = self.adapter.final_norm(self.model), self.adapter.lm_head(self.model)
        share = self.parallel.share(len(finals))
        end = 0
        with self.using(norm, head):
            for k, (hidden, batch) in enumerate(zip(finals, self.batches)):
                start, end = end, end + batch.shape[0]  # this batch's windows
                if share is not None and k not in share:
                    continue
                logits = head(norm(hidden.to(self.device))).float()
                targets = batch[:, 1:].to(self.device)
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
                sums[start:end] = loss.sum(dim=1).double().cpu()
        if share is not None:
            sums = torch.tensor(self.parallel.sum(sums.tolist()), dtype=torch.float64)
        tokens = self.calibration.shape[1] - 1
        if per_window:
            return (sums / tokens).tolist()
        return float(sums.sum()) / (tokens * len(sums))

    # -- targets from the original model ---------------------------------------------------
    def _provide_outputs(self, outputs: list[torch.Tensor]) -> None:
        """``CurrentLayer.provide_outputs``: the layer's outputs on its inputs as the step leaves it."""
        if self._current is None:
            raise RuntimeError("provide_outputs() is only available inside compress_layer")
        if len(outputs) != len(self._current.inputs):
            raise ValueError(f"provide_outputs: {len(outputs)} batches given, {len(self._current.inputs)} expected")
        self._provided = outputs

    @torch.no_grad()
    def original_outputs(self, index: int, inputs: list[torch.Tensor] | None = None,
                         kwargs_list: list[dict[str, Any]] | None = None) -> list[torch.Tensor]:
        """The original layers that layer ``index`` stands for (``layer_origin``), run one after another
        on ``inputs``: the serial computation a merged layer approximates. Without ``inputs``: the original
        model's own hidden states after them (``reference_outputs``)."""
        if inputs is None:
            return self.reference_outputs(index)
        return self._run_original(self.layer_origin[index], inputs, kwargs_list)

    @torch.no_grad()
    def reference_outputs(self, index: int) -> list[torch.Tensor]:
        """Hidden states of the original model after the last original layer that layer ``index`` covers,
        computed from the original model's own inputs. The original layers advance in lockstep with the
        pass (one extra set of activations in memory); calls must come in increasing layer order."""
        last = max(self.layer_origin[index])
        if self._reference_stream is not None and self._reference_stream[0] > last + 1:
            raise RuntimeError(f"reference_outputs({index}) after layer {self._reference_stream[0] - 1}: calls "
                               f"must come in increasing layer order (the original model is not run twice)")
        if self._reference_stream is None:
            states, kwargs_list = self.reference_session().capture_inputs()
            self._reference_stream = (0, states, kwargs_list)
        start, states, kwargs_list = self._reference_stream
        states = self._run_original(range(start, last + 1), states, kwargs_list)
        self._reference_stream = (last + 1, states, kwargs_list)
        return states

    def _run_original(self, indices, states: list[torch.Tensor], kwargs_list: list[dict[str, Any]]):
        """Original layers ``indices`` (of the reference model), one after another, over all batches."""
        reference = self.reference_session()
        for original in indices:
            with reference.using(original):
                states = reference.run_layer(reference.layers[original], states, kwargs_list)
        return states

    # -- layer-sequential compression --------------------------------------------------------
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
        targets = [set(m.target_layers(self)) for m in group]
        reports: list[dict[str, Any]] = [{"layers": {}} for _ in group]
        own = [0.0] * len(group)
        inputs, kwargs_list = self.capture_inputs()
        start, resumed = 0, checkpoints.pass_state() if checkpoints is not None else None
        self._reference_stream = None
        if resumed is not None:  # an interrupted pass: after its last finished layer (``--resume``)
            start, inputs, reports, targets, reference = resumed
            if reference is not None:  # the original model's states where the interrupted run had them
                self._reference_stream = (reference[0], reference[1], self.reference_session().capture_inputs()[1])
        last = max((max(t) for t in targets if t), default=-1)
        for index in self.progress.track(range(start, last + 1), "layer-sequential pass"):
            layer = self.layers[index]
            active = [k for k, t in enumerate(targets) if index in t]
            with self.using(index):
                if not active:
                    inputs = self.run_layer(layer, inputs, kwargs_list)
                    if checkpoints is not None:
                        checkpoints.layer_done(self, index, inputs, reports, targets, self._reference_stream)
                    self.timings.record(**{"pass": "layer-sequential pass", "layer": index, "layers": last + 1})
                    continue
                keep_original = self.config.propagate == "original"
                original_outputs = provided = None
                cache: dict[str, Statistic] = {}
                for k in active:
                    modifier, started = group[k], time.perf_counter()
                    self.timings.split("shared")
                    needed = modifier.statistics(self, index)
                    missing = [s for s in needed if s.key not in cache]
                    if missing or (keep_original and original_outputs is None):
                        outputs = self.run_layer(layer, inputs, kwargs_list, hooks=missing)
                        original_outputs = original_outputs if original_outputs is not None else outputs
                        cache.update({s.key: s for s in missing})
                    self._current = CurrentLayer(inputs, kwargs_list, self._provide_outputs)
                    self._provided = None
                    try:
                        with self.timings.phase("compress"):
                            entry = modifier.compress_layer(self, index, {s.key: cache[s.key] for s in needed})
                        provided = self._provided
                    finally:
                        self._current = self._provided = None
                    reports[k]["layers"][str(index)] = entry
                    changed = min((change_position(m) for m in modifier.modifies), default=99)
                    cache = {key: s for key, s in cache.items() if s.position <= changed and not s.released}
                    own[k] += time.perf_counter() - started
                    self.timings.split(modifier.step_name())
                if self.parallel.active:  # the guard: every rank compressed this layer alike
                    entries = [r["layers"].get(str(index)) for r in reports]
                    self.parallel.agree(f"layer {index}", module_digest(self.layers[index], entries))
                if keep_original:
                    inputs = original_outputs
                elif provided is not None:
                    inputs = provided
                else:
                    inputs = self.run_layer(self.layers[index], inputs, kwargs_list)
            if checkpoints is not None:
                checkpoints.layer_done(self, index, inputs, reports, targets, self._reference_stream)
            self.timings.record(**{"pass": "layer-sequential pass", "layer": index, "layers": last + 1})
        self._reference_stream = None
        for k, modifier in enumerate(group):
            started = time.perf_counter()
            reports[k].update(modifier.finish(self))
            reports[k]["own_s"] = own[k] + time.perf_counter() - started
        return {str(k): r for k, r in enumerate(reports)}
