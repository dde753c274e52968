"""The session as a modifier sees it: :class:`ModifierView`, the engine's implementation of
:class:`~recipe_engine.execution.modifier_session.ModifierSession`.

A view reads the facts of one :class:`~recipe_engine.execution.session.Session` (its model, calibration
windows, layer origins, ...) and of the run it belongs to (``RunContext``), and is where the protocol's
modifier-facing operations are written: layer surgery, residency blocks (over ``Residency``), the whole-model
pass with its ``as_received`` policy and the calibration loss (over ``LayerPipeline``), the original model's
outputs (over ``ReferenceWalk``), shared work, and branches. Only ``capture_inputs`` and ``run_layer`` are the
pipeline's own operations, which the engine's pass runs too; the view gives modifiers them without the
pipeline's engine-only options.

A view holds its session (``session``, the engine's side, not part of the protocol); the session holds its
view weakly, so a branch a step drops is freed at once. The view is the session's modifier-facing half: the
only module besides ``session.py`` that changes a session's state (its layers and their origins).
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..architectures.shape import ModelShape
from .activations import Activations
from .modifier_session import CurrentLayer
from .outputs import RunOutputs
from .steps import run_steps

if TYPE_CHECKING:
    from ..recipe.modifier import Modifier
    from .session import Session
    from .stats import Statistic


def _run_fact(name: str) -> property:
    """A read-only property of the view returning the run's ``RunContext.<name>``."""
    return property(lambda view: getattr(view.session.context, name), doc=f"The run's ``{name}``.")


class ModifierView:
    """One session as a modifier sees it (``ModifierSession``; the module docstring says what is written here)."""

    def __init__(self, session: "Session"):
        #: The engine's session behind this view (engine code only: ``StagedLayer``, the steps).
        self.session = session
        #: Report records of the steps this view ran as a branch (``branch``).
        self.records: list[dict[str, Any]] = []

    # -- facts: the run's (``RunContext``'s; typed in ``ModifierSession``) ----------------------
    tokenizer = _run_fact("tokenizer")
    adapter = _run_fact("adapter")
    config = _run_fact("config")
    device = _run_fact("device")
    storage = _run_fact("storage")
    progress = _run_fact("progress")
    passes = _run_fact("passes")

    # -- facts: the session's ------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self.session.model

    @property
    def calibration(self) -> torch.Tensor:
        return self.session.calibration

    @property
    def batches(self) -> list[torch.Tensor]:
        return self.session.batches

    @property
    def layers(self) -> nn.ModuleList:
        return self.session.layers

    @property
    def layer_origin(self) -> list[tuple[int, ...]]:
        return self.session.layer_origin

    @property
    def shape(self) -> ModelShape:
        return self.session.shape

    @property
    def outputs(self) -> RunOutputs:
        return self.session.outputs

    @property
    def streamed(self) -> bool:
        """The model is a meta-device skeleton whose weights stream from disk."""
        return self.session.stream is not None

    @property
    def reference(self) -> "ModifierView":
        """The original model's session (``Session.reference_session``), as a modifier sees it."""
        return self.session.reference_session().view

    @property
    def current_layer(self) -> CurrentLayer:
        """The layer the layer-sequential pass is compressing: its inputs and the outputs hand-over (valid
        inside ``compress_layer`` only)."""
        if self.session.pipeline.current is None:
            raise RuntimeError("current_layer is only available inside compress_layer")
        return self.session.pipeline.current

    @property
    def scratch_directory(self) -> Path | None:
        """Where a step of a streamed run may spill large working data to disk (the staging directory,
        inside the output's temporary directory, so it goes with it; a temporary directory for a read-only
        stream); ``None`` for an in-memory model (keep it in memory)."""
        stream = self.session.stream
        if stream is None:
            return None
        if stream.staging is None:
            return Path(tempfile.gettempdir())
        stream.staging.mkdir(parents=True, exist_ok=True)
        return stream.staging

    # -- layer surgery -------------------------------------------------------------------------
    def set_layers(self, layers: list[nn.Module], origin: list[tuple[int, ...]], inherit: list[int]) -> None:
        """Replace the decoder layers; ``origin`` gives the original indices each new layer covers,
        ``inherit`` the current index whose per-layer config entries it keeps."""
        self.adapter.set_layers(self.model, layers, inherit)
        self.session.layer_origin = list(origin)  # a new list: a step may hold the old one

    # -- calibration forwards ------------------------------------------------------------------
    def capture_inputs(self) -> Activations:
        return self.session.pipeline.capture_inputs()

    def run_layer(self, layer: nn.Module, inputs: Activations, hooks: "list[Statistic]" = (),
                  on_batch: Callable[[int, torch.Tensor], None] | None = None) -> Activations:
        return self.session.pipeline.run_layer(layer, inputs, hooks, on_batch)

    def layer_pass(self, visit: Callable[[int, Activations, Activations], None],
                   description: str = "calibration pass", skip: tuple[int, ...] = (), *,
                   as_received: bool = False) -> None:
        """``LayerPipeline.layer_pass`` over this model; with ``as_received`` (the step has not changed the
        model), when ``Session.keep_reference_states`` and the activations live on the host, the reference
        session makes the pass instead and keeps its states: the same function up to rounding (only
        output-preserving steps ran), and the very computation a later ``original_outputs`` would repeat, so
        its kept states are bit for bit what that walk gives (a resumed run, which has none kept, walks to the
        same result)."""
        s = self.session
        if as_received and not skip and s.keep_reference_states and s.context.storage.type == "cpu":
            s.reference_session().pipeline.layer_pass(visit, description, keep=True)
        else:
            s.pipeline.layer_pass(visit, description, skip)

    @torch.no_grad()
    def calibration_nll(self, skip: tuple[int, ...] = (), finals: Activations | None = None,
                        per_window: bool = False) -> float | list[float]:
        """Token-weighted mean next-token NLL of the calibration windows (layers in ``skip`` bypassed;
        at least one layer must run). With ``finals``, the last decoder layer's outputs (e.g. of a model
        assembled by the step), no pass is made (``LayerPipeline.final_nll``). ``per_window``: each window's
        mean NLL instead, in window order (windows are equally long: their mean is the former)."""
        pipeline = self.session.pipeline
        if finals is not None:
            if skip:
                raise ValueError("calibration_nll: skip and finals exclude each other")
            return pipeline.final_nll(finals, per_window)
        last: list[Activations] = []

        def keep_last(index: int, _inputs, outputs: Activations) -> None:
            last[:] = [outputs]

        pipeline.layer_pass(keep_last, "calibration NLL", skip=skip)
        if not last:
            raise ValueError("calibration_nll: every layer is skipped (at least one must run)")
        return pipeline.final_nll(last[0], per_window)

    # -- the original model --------------------------------------------------------------------
    def original_outputs(self, index: int, inputs: Activations | None = None) -> Activations:
        """The original layers that layer ``index`` stands for (``layer_origin``), run one after another
        on ``inputs``: the serial computation a merged layer approximates. Without ``inputs``: the original
        model's own hidden states after them (``ReferenceWalk.reference_outputs``)."""
        walk = self.session.pipeline.walk
        if inputs is None:
            return walk.reference_outputs(index)
        return walk.run_original(self.layer_origin[index], inputs)

    # -- residency -----------------------------------------------------------------------------
    def placed(self, *items: int | nn.Module, on_device: bool = True) -> contextlib.AbstractContextManager:
        """``on_device``: layers named by current index are the model's own (``Residency.using``: read from
        disk onto the device when streamed, else moved there and back); modules given as objects are moved to
        the device and back (``Residency.on_device``: a module a step built, another model, a layer the block
        already holds). ``on_device=False``: layers or model parts (embeddings, final norm, ``lm_head``)
        materialized in host memory for the block (``Residency.loaded``; a no-op in memory)."""
        residency = self.session.residency
        if not on_device:
            return residency.loaded(*items)
        indices = [item for item in items if isinstance(item, int)]
        modules = [item for item in items if not isinstance(item, int)]
        if not modules:
            return residency.using(*indices)
        if not indices:
            return residency.on_device(*modules)
        block = contextlib.ExitStack()
        block.enter_context(residency.using(*indices))
        block.enter_context(residency.on_device(*modules))
        return block

    def release(self, module: nn.Module) -> None:
        """Stage a module built by a step (e.g. a merged layer) and free its weights (streamed models)."""
        if self.session.stream is not None:
            self.session.stream.release(module)

    # -- shared work ---------------------------------------------------------------------------
    def shared(self, step: "Modifier", label: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, or its value from an earlier sweep variant in the same state (``memo``, keyed by the
        steps completed so far)."""
        memo = self.session.memo
        return compute() if memo is None else memo.step_value(step, self.session.completed_steps, label, compute)

    def map(self, function: Callable[[Any], Any], items: list) -> list:
        """``[function(x) for x in items]``; a data-parallel run spreads the items over the ranks and gathers
        the results, so every rank gets the same list (for independent solves, e.g. candidate subsets)."""
        return self.session.context.parallel.map(function, list(items))

    # -- alternatives side by side -------------------------------------------------------------
    def branch(self, calibration: torch.Tensor, steps: "list[Modifier]" = (), *, copy: bool = True,
               memo: Any = None) -> "ModifierView":
        """A session calibrated on ``calibration`` (``Session.fork``). ``copy=True``: over a CPU copy of the
        model as it is now, which runs ``steps`` as a recipe would (consecutive layer steps share a pass; their
        report records in the branch's ``records``; no resume checkpoints). ``copy=False``: over this very
        model, e.g. to score it on other windows (no steps)."""
        if not copy and steps:
            raise ValueError("branch(copy=False) runs no steps (they would change this session's model)")
        branch = self.session.fork(calibration, copy=copy, memo=memo).view
        if steps:
            branch.records.extend(run_steps(branch.session, list(steps), self.progress))
        return branch

    def adopt(self, branch: "ModifierView") -> None:
        """Make this session's model the branch's: its modules (with any hooks on them), config, layer
        origins, extras, artifacts and quantization records move over; the model object stays the same."""
        own, other = self.session, branch.session
        for name, child in list(other.model.named_children()):
            setattr(own.model, name, child)
        own.model.config = other.model.config
        own.layer_origin = list(other.layer_origin)
        own.outputs.adopt(other.outputs)
        own.work.count(other.work.runs, other.work.batches)
