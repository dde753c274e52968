"""The session: one model of a recipe run, with its calibration windows, over the run's shared facts.

A session is a :class:`~recipe_engine.execution.context.RunContext` (what every session of the run shares)
plus what is its own: the model and where its layers came from, the calibration windows, the weight stream,
the sweep memo and the outputs collector. What it does is split by owner: weight residency (``residency``:
materialize, place, release), the layer-sequential pass over the calibration activations (``pipeline``), and
the steps (``recipe_engine.execution.steps``). Modifiers see it through ``view``, a
:class:`~recipe_engine.execution.modifier_view.ModifierView` implementing
:class:`~recipe_engine.execution.modifier_session.ModifierSession`.
"""
from __future__ import annotations

import weakref
from copy import deepcopy
from typing import Any, Callable

import torch
from torch import nn

from ..architectures.shape import WIDTH_INDEX, LayerShape, ModelShape, WidthPart
from ..recipe.modifier import Modifier
from .context import LayerWork, RunContext
from .memo import SharedWork
from .modifier_view import ModifierView
from .outputs import RunOutputs
from .pipeline import LayerPipeline
from .residency import Residency
from .streaming import WeightStream


def remove_layers(session, remove: list[int]) -> list[tuple[int, ...]]:
    """Drop the current layers in ``remove`` from a session (``ModifierSession.set_layers``); returns the
    original indices of what was dropped."""
    keep = [i for i in range(len(session.layers)) if i not in set(remove)]
    dropped = [session.layer_origin[i] for i in sorted(remove)]
    session.set_layers([session.layers[i] for i in keep], [session.layer_origin[i] for i in keep], keep)
    return dropped


def oversized_layers(session: "Session", part: WidthPart | None = None) -> list[int]:
    """Layers wider than the config, read from the weights: in query heads (``part="attention"``), in
    intermediate size (``"mlp"``), or in either (``None``, which also compares KV heads)."""
    cfg, adapter = session.model.config, session.context.adapter
    standard = (cfg.num_attention_heads, cfg.num_key_value_heads, adapter.intermediate_size(cfg))
    picked = WIDTH_INDEX[part]
    return [i for i, layer in enumerate(session.layers)
            if [adapter.layer_widths(layer, session.head_dim)[k] for k in picked] != [standard[k] for k in picked]]


class Session:
    """One model of a recipe run over the run's shared ``context`` (no globals). Modifiers see it through
    ``view``; the rest is the engine's.

    Its own: ``model``, ``calibration`` (token windows), ``stream`` (residency of a streamed model,
    ``recipe_engine.execution.streaming``), ``memo`` (work shared by a sweep's variants; None in a plain run),
    ``outputs`` (the extras collector); ``matches_reference``: the model still computes its reference's
    function (the creator knows it; kept by ``end_group``). ``reference_loader`` gives the original model (a
    module or a session) for ``reference_session``. Resume checkpoints are passed to the pass that writes
    them (``LayerPipeline.run_layer_modifiers``).
    """

    def __init__(self, context: RunContext, model: nn.Module, calibration: torch.Tensor | None, *,
                 stream: WeightStream | None = None,
                 reference_loader: Callable[[], "nn.Module | Session"] | None = None,
                 memo: SharedWork | None = None, outputs: RunOutputs | None = None, matches_reference: bool = False):
        self.context, self.model, self.calibration, self.stream, self.memo = context, model, calibration, stream, memo
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        #: The original indices each current layer covers (replaced by the view's ``set_layers`` and ``adopt``).
        self.layer_origin: list[tuple[int, ...]] = [(i,) for i in range(cfg.num_hidden_layers)]
        #: Decoder layers of the model the run started from (``layer_origin`` indexes into them).
        self.original_layers = cfg.num_hidden_layers
        #: Extras, artifacts and quantization records the steps produce (``recipe_engine.execution.outputs``).
        self.outputs = outputs if outputs is not None else RunOutputs()
        #: Layer runs and calibration batches run by this session (``run_layer``, staged layers).
        self.work = LayerWork()
        self._reference_loader = reference_loader
        self._reference: Session | None = None
        self._view: Callable[[], ModifierView | None] = lambda: None
        #: The canonical parameters of the steps completed so far (``steps`` extends it): they key the memo.
        self.completed_steps: list[str] = []
        #: The model still computes its reference's function: only output-preserving steps have completed
        #: (``Modifier.preserves_outputs``; kept by ``end_group``).
        self.matches_reference = matches_reference
        #: Set while a step runs on a model that matches its reference and a later step reads the
        #: reference's hidden states (``begin_group``): its ``as_received`` passes run the reference and keep them.
        self.keep_reference_states = False
        #: Owner of weight residency (``using``, ``loaded``, ``on_device``, ...).
        self.residency = Residency(self)
        #: Owner of the calibration activations and the layer-sequential pass.
        self.pipeline = LayerPipeline(self)

    @property
    def view(self) -> ModifierView:
        """This session as a modifier sees it. The view holds the session, not the other way round (a weak
        reference), so a branch a step dropped is freed at once, without the cyclic collector."""
        view = self._view()
        if view is None:
            view = ModifierView(self)
            self._view = weakref.ref(view)
        return view

    @property
    def layers(self) -> nn.ModuleList:
        return self.context.adapter.layers(self.model)

    @property
    def batches(self) -> list[torch.Tensor]:
        """The calibration windows in batches of ``config.batch_size``."""
        return list(self.calibration.split(self.context.config.batch_size))

    @property
    def shape(self) -> ModelShape:
        """The symbolic shape of the model as it is now (widths read from the weights, ``layer_origin``),
        for checking steps against the model mid-run."""
        shape = ModelShape.from_config(self.model.config)
        shape.original_layers = self.original_layers
        shape.layers = [LayerShape(*self.context.adapter.layer_widths(layer, self.head_dim)[:3], tuple(origin))
                        for layer, origin in zip(self.layers, self.layer_origin)]
        shape.streamed = self.stream is not None
        shape.stock_only = self.context.stock_only
        shape.dtype_bytes = self.model.dtype.itemsize
        return shape

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
                **own) -> "Session":
        """A session over ``model`` sharing this one's context (``own``: the keyword arguments of
        ``Session``: memo, outputs, ...); ``calibration``: its windows, else this session's."""
        return Session(self.context, model, self.calibration if calibration is None else calibration,
                       stream=stream, **own)

    def fork(self, calibration: torch.Tensor, *, copy: bool = True, memo: SharedWork | None = None) -> "Session":
        """A session calibrated on ``calibration`` with this one's layer origins; ``memo`` (a ``SharedWork``)
        shares work between sessions over the same windows (``ModifierSession.branch``).

        ``copy=True``: over a CPU copy of the model as it is now, with this session's completed steps, outputs
        (copied) and reference model over the same windows; this session is untouched until the view's
        ``adopt``. In-memory models only (a streamed model has no second copy to branch into).
        ``copy=False``: over this very model (streamed or not), e.g. to score it on other windows."""
        if not copy:
            fork = self.sibling(self.model, self.stream, calibration, memo=memo)
        elif self.stream is not None:
            raise RuntimeError("a streamed session cannot branch (its weights live in one staged copy)")
        else:
            reference_loader = None
            if self._reference_loader is not None or self._reference is not None:
                reference_loader = lambda: (lambda ref: ref.sibling(ref.model, ref.stream, calibration))(
                    self.reference_session())
            copies: dict[int, Any] = {}  # deepcopy's memo: each original object → its copy
            model = deepcopy(self.model, copies).to("cpu")
            fork = self.sibling(model, None, calibration, memo=memo, reference_loader=reference_loader,
                                matches_reference=self.matches_reference, outputs=self.outputs.copy_for(copies))
            fork.completed_steps = list(self.completed_steps)
        fork.layer_origin, fork.original_layers = list(self.layer_origin), self.original_layers
        return fork
