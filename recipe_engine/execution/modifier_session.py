"""What a modifier may do with the session it is handed: the :class:`ModifierSession` protocol.

The engine implements it as :class:`~recipe_engine.execution.modifier_view.ModifierView`, the view of a
:class:`~recipe_engine.execution.session.Session` a step is handed (the session has more: residency of a
streamed model, data-parallel ranks, resume checkpoints, the sweep memo, the pass over layer steps); a
modifier sees only this. ``tests/test_modifier_api.py`` checks every built-in modifier uses nothing else.

Twelve methods, by what a modifier does:

* layer surgery: :meth:`~ModifierSession.set_layers` (``remove_layers`` in ``recipe_engine.api`` is built on it);
* calibration forwards: :meth:`~ModifierSession.capture_inputs`, :meth:`~ModifierSession.run_layer`,
  :meth:`~ModifierSession.layer_pass`, :meth:`~ModifierSession.calibration_nll`;
* the original model's outputs: :meth:`~ModifierSession.original_outputs` (the original model's own
  session is the ``reference`` fact);
* residency: :meth:`~ModifierSession.placed` (a block with weights loaded or on the device) and
  :meth:`~ModifierSession.release` (a module a step built, staged to disk when the model streams);
* shared work: :meth:`~ModifierSession.shared` (across a sweep's variants), :meth:`~ModifierSession.map`
  (across data-parallel ranks);
* alternatives side by side (a combinator): :meth:`~ModifierSession.branch`, :meth:`~ModifierSession.adopt`.

Nineteen read-only facts (properties): the run's ``model``, ``tokenizer``, ``adapter``, ``config``
(calibration settings), ``calibration`` (token windows) and their ``batches``, ``device`` and ``storage``
(where activations live), ``progress``; the model's ``layers``, ``layer_origin``, symbolic ``shape``,
whether it is ``streamed`` and its ``scratch_directory``; ``reference`` (the original model's session);
``records`` (of steps a branch ran). Three facts carry callables of their own, six in all:
``current_layer`` (inside ``compress_layer``: :class:`CurrentLayer`'s ``inputs``, an
:class:`~recipe_engine.execution.activations.Activations`, ``provide_outputs`` and ``sum_over_ranks``),
``passes`` (:class:`PassCounter`: ``value``, ``count()``) and ``outputs`` (the run's
extras collector, :class:`~recipe_engine.execution.outputs.RunOutputs`: ``add_extra``, ``add_artifact``,
``add_rows``, ``mark_quantized``).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

import torch
from torch import nn

from ..architectures.adapters import ArchitectureAdapter
from ..architectures.shape import ModelShape
from ..recipe.schema import CalibrationConfig
from ..system.progress import Progress
from .activations import Activations
from .outputs import RunOutputs

if TYPE_CHECKING:
    from .stats import Statistic
    from ..recipe.modifier import Modifier


class PassCounter:
    """Calibration passes of a run, shared by a session and its siblings (the reference model, branches):
    one pass is one walk of calibration windows through the decoder layers. ``capture_inputs`` counts one;
    a step that walks from inputs it kept, or runs whole models over the windows, calls :meth:`count`."""

    def __init__(self) -> None:
        self.value = 0

    def count(self) -> None:
        """Count one calibration pass."""
        self.value += 1


class CurrentLayer(NamedTuple):
    """The layer a layer-sequential pass is compressing, as ``compress_layer`` sees it."""

    #: The activations entering the layer: per batch its hidden states and keyword arguments (attention mask,
    #: rotary embeddings, ...), on ``storage`` (never modify them in place).
    inputs: Activations
    #: ``provide_outputs(outputs)``: the layer's outputs on ``inputs`` as this step leaves it, computed by the
    #: step anyway; the pass takes them as the next layer's inputs instead of running the layer again
    #: (unless a later step changes the layer).
    provide_outputs: Callable[[Activations], None]
    #: ``sum_over_ranks(statistics)``: sum each statistic a step gathered itself (its ``sums``, fp64) over the
    #: data-parallel ranks when they split this layer's batches; whether they did (False: one process).
    sum_over_ranks: Callable[[list], bool]


class ModifierSession(Protocol):
    """The session as a modifier sees it (see the module docstring for the grouping and the count)."""

    # -- facts (read-only) ---------------------------------------------------------------------
    @property
    def model(self) -> nn.Module: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def adapter(self) -> ArchitectureAdapter: ...
    @property
    def config(self) -> CalibrationConfig: ...
    @property
    def calibration(self) -> torch.Tensor: ...
    @property
    def batches(self) -> list[torch.Tensor]: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def storage(self) -> torch.device: ...
    @property
    def progress(self) -> Progress: ...
    @property
    def layers(self) -> nn.ModuleList: ...
    @property
    def layer_origin(self) -> list[tuple[int, ...]]: ...
    @property
    def shape(self) -> ModelShape: ...
    @property
    def streamed(self) -> bool: ...
    @property
    def scratch_directory(self) -> Path | None: ...
    @property
    def reference(self) -> "ModifierSession": ...
    @property
    def current_layer(self) -> CurrentLayer: ...
    @property
    def records(self) -> list[dict[str, Any]]: ...
    @property
    def passes(self) -> PassCounter: ...
    @property
    def outputs(self) -> RunOutputs: ...

    # -- layer surgery -------------------------------------------------------------------------
    def set_layers(self, layers: list[nn.Module], origin: list[tuple[int, ...]], inherit: list[int]) -> None:
        """Replace the decoder layers; ``origin`` gives the original indices each new layer covers,
        ``inherit`` the current index whose per-layer config entries it keeps."""

    # -- calibration forwards ------------------------------------------------------------------
    def capture_inputs(self) -> Activations:
        """The activations entering decoder layer 0 (hidden states and keyword arguments per batch); counts a pass."""

    def run_layer(self, layer: nn.Module, inputs: Activations, hooks: "list[Statistic]" = (),
                  on_batch: Callable[[int, torch.Tensor], None] | None = None) -> Activations:
        """Run one (placed) layer over all batches of ``inputs``, feeding ``hooks``; returns its outputs."""

    def layer_pass(self, visit: Callable[[int, Activations, Activations], None],
                   description: str = "calibration pass", skip: tuple[int, ...] = (), *,
                   as_received: bool = False) -> None:
        """``visit(index, inputs, outputs)`` for every layer of one whole-model pass (``skip``: bypassed).
        ``as_received``: the step has not changed the model yet (a statistics pass before its changes); when
        only output-preserving steps ran before it and a later step reads the original model's hidden
        states, the pass runs the reference's layers (the same function) and keeps their states, so that
        later step's ``original_outputs(index)`` need not run the original model again."""

    def calibration_nll(self, skip: tuple[int, ...] = (), finals: Activations | None = None,
                        per_window: bool = False) -> float | list[float]:
        """Token-weighted mean next-token NLL of the calibration windows (layers in ``skip`` bypassed), or
        of given last-layer outputs ``finals``; ``per_window``: each window's mean NLL, in window order."""

    # -- the original model --------------------------------------------------------------------
    def original_outputs(self, index: int, inputs: Activations | None = None) -> Activations:
        """The original layers behind layer ``index`` run serially on ``inputs``; without ``inputs``, the
        original model's own hidden states after them (in increasing layer order)."""

    # -- residency -----------------------------------------------------------------------------
    def placed(self, *items: int | nn.Module, on_device: bool = True) -> contextlib.AbstractContextManager:
        """A block with these layers (current indices) or modules on the session device; ``on_device=False``:
        only materialized in host memory (a streamed model's layers or parts; a no-op in memory)."""

    def release(self, module: nn.Module) -> None:
        """Stage a module built by a step and free its weights (a streamed model; a no-op in memory)."""

    # -- shared work ---------------------------------------------------------------------------
    def shared(self, step: "Modifier", label: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, or its value from an earlier sweep variant in the same state."""

    def map(self, function: Callable[[Any], Any], items: list) -> list:
        """``[function(x) for x in items]``, spread over data-parallel ranks (every rank gets all results)."""

    # -- alternatives side by side -------------------------------------------------------------
    def branch(self, calibration: torch.Tensor, steps: "list[Modifier]" = (), *, copy: bool = True,
               memo: Any = None) -> "ModifierSession":
        """A session calibrated on ``calibration``: over a CPU copy of the model that runs ``steps`` (their
        records in ``records``), or with ``copy=False`` over this very model (steps not allowed)."""

    def adopt(self, branch: "ModifierSession") -> None:
        """Make this session's model the branch's (modules, config, layer origins, outputs)."""
