"""The shared calibration session: one recipe run's explicit state, passed to every modifier.

A session holds the model, its calibration windows and device, and the run's collaborators. What it does is
split by owner: weight residency (``recipe_engine.execution.residency``: materialize, place, release), the
layer-sequential pass over the calibration activations (``recipe_engine.execution.pipeline``), and the steps
(``recipe_engine.execution.steps``). Modifiers see it through
:class:`~recipe_engine.execution.modifier_session.ModifierSession`.
"""
from __future__ import annotations

import contextlib
from copy import deepcopy
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..architectures.adapters import ArchitectureAdapter
from ..architectures.shape import WIDTH_INDEX, LayerShape, ModelShape, WidthPart
from ..recipe.modifier import LayerModifier, Modifier
from ..recipe.schema import CalibrationConfig
from ..system.progress import Progress
from .activations import Activations
from .distributed import Parallel
from .memo import SharedWork
from .modifier_session import CurrentLayer, PassCounter
from .outputs import RunOutputs
from .pipeline import LayerPipeline
from .residency import Residency
from .stats import Statistic
from .steps import run_steps
from .streaming import WeightStream
from .timings import Timings


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
                 original_layers: int | None = None, completed: list[str] = (), timings: Timings | None = None,
                 matches_reference: bool = False, stock_only: bool = False, offload: bool | None = None):
        self.model, self.tokenizer, self.adapter = model, tokenizer, adapter
        #: Calibration passes made so far by this session and its siblings (``recipe plan`` predicts them).
        self.passes = passes or PassCounter()
        #: This process's rank in a data-parallel run (``recipe_engine.execution.distributed``); one process: a no-op.
        self.parallel = parallel or Parallel(device=device)
        #: Set when the model is a meta-device skeleton streamed from disk (``recipe_engine.execution.streaming``).
        self.stream = stream
        self.calibration, self.config, self.device = calibration, config, device
        #: ``calibration.offload`` resolved (the runner decides ``auto``; not given: true unless it is false):
        #: the activations live on the host between layers. The recipe's own value is left as written.
        self.offload = offload if offload is not None else config.offload is not False
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
        #: Work shared across a sweep's variants (``recipe_engine.execution.memo``), None in a plain run; the
        #: canonical parameters of the steps completed so far (``mark_completed``) key it.
        self.memo = memo
        self.completed_steps: list[str] = list(completed)
        #: The model still computes its reference's function: only output-preserving steps have completed
        #: (``Modifier.preserves_outputs``; kept by ``end_group``). False unless the creator knows it.
        self.matches_reference = matches_reference
        #: Set while a step runs on a model that matches its reference and a later step reads the
        #: reference's hidden states (``begin_group``): its ``as_received`` passes run the reference and keep them.
        self.keep_reference_states = False
        #: The run's result must be a stock checkpoint (the recipe exports it): ``ModelShape.stock_only``.
        self.stock_only = stock_only
        #: Report records of the steps this session ran (``run_steps``; a branch's, see ``branch``).
        self.records: list[dict[str, Any]] = []
        #: The run's phase clock and timings log (``recipe_engine.execution.timings``), shared by siblings.
        self.timings = timings if timings is not None else Timings()
        #: Owner of weight residency (``placed``, ``using``, ``loaded``, ``release``, ...).
        self.residency = Residency(self)
        #: Owner of the calibration activations and the layer-sequential pass.
        self.pipeline = LayerPipeline(self)

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
        if self.pipeline.current is None:
            raise RuntimeError("current_layer is only available inside compress_layer")
        return self.pipeline.current

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
        standard = (cfg.num_attention_heads, cfg.num_key_value_heads, self.adapter.intermediate_size(cfg))
        picked = WIDTH_INDEX[part]
        return [i for i, layer in enumerate(self.layers)
                if [self.adapter.layer_widths(layer, self.head_dim)[k] for k in picked]
                != [standard[k] for k in picked]]

    def begin_group(self, later: list[Modifier]) -> None:
        """A step (or steps sharing a pass) starts: its ``as_received`` passes keep the reference's states when
        the model still matches the reference and a ``later`` step reads the reference."""
        self.keep_reference_states = self.matches_reference and any(step.needs_reference for step in later)

    def end_group(self, steps: list[Modifier], later: list[Modifier]) -> None:
        """``steps`` completed (or a resumed run skips them as completed): the model still matches its
        reference only if they all preserve outputs; kept reference states go once no ``later`` step reads them."""
        self.keep_reference_states = False
        self.matches_reference &= all(step.preserves_outputs for step in steps)
        if self._reference is not None and not any(step.needs_reference for step in later):
            self._reference.pipeline.walk.kept = None

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
        return Session(model, self.tokenizer, self.adapter, self.calibration if calibration is None else calibration,
                       self.config, self.device, self.progress, stream=stream, parallel=self.parallel,
                       passes=self.passes, timings=self.timings, offload=self.offload, **state)

    # -- branches: alternatives run side by side (a step choosing between them) -------------
    def current_shape(self) -> ModelShape:
        """The symbolic shape of the model as it is now (widths read from the weights, ``layer_origin``),
        for checking steps against the model mid-run."""
        shape = ModelShape.from_config(self.model.config)
        shape.original_layers = self.original_layers
        shape.layers = [LayerShape(*self.adapter.layer_widths(layer, self.head_dim)[:3], tuple(origin))
                        for layer, origin in zip(self.layers, self.layer_origin)]
        shape.streamed = self.stream is not None
        shape.stock_only = self.stock_only
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
                              matches_reference=self.matches_reference,
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
        """Where calibration activations live between layers (``calibration.offload``, resolved)."""
        return torch.device("cpu") if self.offload else self.device

    @property
    def batches(self) -> list[torch.Tensor]:
        """The calibration windows in batches of ``config.batch_size``."""
        return list(self.calibration.split(self.config.batch_size))

    def map(self, function: Callable[[Any], Any], items: list) -> list:
        """``[function(x) for x in items]``; a data-parallel run spreads the items over the ranks and gathers
        the results, so every rank gets the same list (for independent solves, e.g. candidate subsets)."""
        return self.parallel.map(function, list(items))

    def shared(self, step, label: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, or its value from an earlier sweep variant in the same state (``memo``)."""
        return compute() if self.memo is None else self.memo.step_value(step, self.completed_steps, label, compute)

    # -- residency (``recipe_engine.execution.residency``) --------------------------------------
    def units_of(self, items) -> list[nn.Module]:
        return self.residency.units_of(items)

    def loaded(self, *items: int | nn.Module) -> contextlib.AbstractContextManager:
        return self.residency.loaded(*items)

    def using(self, *items: int | nn.Module) -> contextlib.AbstractContextManager:
        return self.residency.using(*items)

    def placed(self, *items: int | nn.Module, on_device: bool = True) -> contextlib.AbstractContextManager:
        return self.residency.placed(*items, on_device=on_device)

    def release(self, module: nn.Module) -> None:
        self.residency.release(module)

    @property
    def scratch_directory(self) -> Path | None:
        return self.residency.scratch_directory

    def stream_units(self) -> list[nn.Module]:
        return self.residency.stream_units()

    def resident(self) -> contextlib.AbstractContextManager:
        return self.residency.resident()

    def on_device(self, *modules: nn.Module) -> contextlib.AbstractContextManager:
        return self.residency.on_device(*modules)

    # -- the layer-sequential pass (``recipe_engine.execution.pipeline``) -------------------------
    def capture_inputs(self) -> Activations:
        return self.pipeline.capture_inputs()

    def run_layer(self, layer: nn.Module, inputs: Activations, hooks: list[Statistic] = (),
                  on_batch: Callable[[int, torch.Tensor], None] | None = None) -> Activations:
        return self.pipeline.run_layer(layer, inputs, hooks, on_batch)

    def layer_pass(self, visit: Callable[[int, Activations, Activations], None],
                   description: str = "calibration pass", skip: tuple[int, ...] = (), *,
                   as_received: bool = False) -> None:
        self.pipeline.layer_pass(visit, description, skip, as_received=as_received)

    def calibration_nll(self, skip: tuple[int, ...] = (), finals: Activations | None = None,
                        per_window: bool = False) -> float | list[float]:
        return self.pipeline.calibration_nll(skip, finals, per_window)

    def final_nll(self, finals: Activations, per_window: bool = False) -> float | list[float]:
        return self.pipeline.final_nll(finals, per_window)

    def original_outputs(self, index: int, inputs: Activations | None = None) -> Activations:
        return self.pipeline.walk.original_outputs(index, inputs)

    def reference_outputs(self, index: int) -> Activations:
        return self.pipeline.walk.reference_outputs(index)

    def run_layer_modifiers(self, group: list[LayerModifier], checkpoints=None) -> dict[str, dict[str, Any]]:
        return self.pipeline.run_layer_modifiers(group, checkpoints)
