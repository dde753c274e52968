"""The modifier contract: a pydantic parameter model plus the code that acts on the session.

Two kinds (the engine reads ``scope``, never a modifier's name):

* ``Modifier`` (``scope = "model"``): ``apply(session)`` sees the whole model. Steps that choose layers
  to merge or drop use ``session.layer_pass`` / ``session.calibration_nll`` for their statistics.
* ``LayerModifier`` (``scope = "layer"``): consecutive layer modifiers share one layer-sequential
  calibration pass. For each target layer the session collects the union of the statistics they declare
  (``statistics``), then calls ``compress_layer`` of each in recipe order. A ``compress_layer`` that
  returns with the layer changed marks collected statistics stale; the next modifier gets fresh ones.

Parameters are pydantic fields (``extra="forbid"``): the schema is the only place defaults live.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import ConfigDict

from ..architectures.shape import ModelShape
from ..errors import RecipeError
from .strict import StrictParameters

if TYPE_CHECKING:
    from .schema import CalibrationConfig
    from ..execution.modifier_session import ModifierSession
    from ..execution.stats import Statistic


class Modifier(StrictParameters):
    """Base class of every recipe step (a boolean is not a number, floats are finite: ``strict``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    scope: ClassVar[Literal["model", "layer"]] = "model"
    #: Calibration passes this step makes (``recipe plan``; ``passes`` when it depends on parameters). A pass
    #: is one walk of calibration windows through the decoder layers, counted by the session
    #: (``ModifierSession.passes``); a run's report records the count beside the plan's.
    calibration_passes: ClassVar[int] = 0
    #: Human-readable statistics this step needs (shown by ``recipe plan``).
    needs: ClassVar[tuple[str, ...]] = ()
    #: True when the step reads ``session.reference`` (an in-memory model is then copied first).
    needs_reference: ClassVar[bool] = False
    #: True when ``apply`` works on a streamed model (loads what it touches with ``session.placed``);
    #: otherwise the engine materializes the whole model around it (``recipe plan``
    #: says so). Layer-scope steps act on the layer the pass has loaded.
    streams: ClassVar[bool] = False
    #: Why this step cannot run on a streamed model, or None when it can (with ``streams`` or materialized):
    #: ``recipe apply`` refuses a streamed run of such a step before any weight is loaded.
    refuses_streaming: ClassVar[str | None] = None
    #: True for steps whose output packs weights on a quantization grid (a later weight change is a
    #: validation error: it would fail when packing).
    quantizes: ClassVar[bool] = False
    #: False for steps that never change a weight's values (e.g. they only drop whole layers).
    changes_weights: ClassVar[bool] = True
    #: True for steps whose output computes the same function as their input up to floating-point rounding
    #: (e.g. folding norm gains into linears): a model changed only by such steps still stands for its
    #: reference, so a later pass can run the reference's layers instead and keep their states
    #: (``ModifierSession.layer_pass``'s ``as_received``).
    preserves_outputs: ClassVar[bool] = False
    #: True for steps whose pass runs ``layer_pass(..., as_received=True)``: while the model still stands for
    #: its reference, that pass keeps the original model's states after every layer for a later step that
    #: reads the reference (``recipe plan`` counts them: ``estimates.kept_states_bytes``).
    keeps_original_states: ClassVar[bool] = False
    #: False when the output is no longer a stock checkpoint (``recipe_engine.load_model`` restores it).
    stock_output: ClassVar[bool] = True
    #: Parameters that ``session.shared`` values of this step do not depend on (reused across a sweep).
    shared_ignores: ClassVar[tuple[str, ...]] = ()
    #: Steps of a minimal valid recipe that exercises this modifier on a tiny model (contract tests);
    #: empty means the modifier alone with its defaults.
    example: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def step_name(cls) -> str:
        return cls.__name__

    @classmethod
    def summary(cls) -> str:
        """First line of the class docstring."""
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    @classmethod
    def example_steps(cls) -> list[str]:
        return list(cls.example) or [cls.step_name()]

    def output_is_stock(self, shape) -> bool:
        """Whether this step's output is a stock checkpoint on a model of ``shape`` (the step's
        ``stock_output`` unless a parameter resolves against the architecture)."""
        return self.stock_output

    def fail(self, message: str, field: str | None = None) -> RecipeError:
        """Build a :class:`RecipeError` for this step (the engine adds file and step index)."""
        return RecipeError(message, modifier=self.step_name(), field=field)

    def passes(self, shape: ModelShape) -> int | tuple[int, int]:
        """Calibration passes for ``recipe plan`` on the shape this step receives: a count, or (fewest, most)
        when it depends on the data. Override when it depends on parameters or the shape."""
        return self.calibration_passes

    def check(self, shape: ModelShape) -> None:
        """Validate against the symbolic model shape and update it to what this step produces.

        Raise ``self.fail(...)`` on a mistake. Runs on config only, before any weight is loaded.
        """

    def working_memory(self, shape: ModelShape, tokens: int) -> int:
        """Bytes this step holds beyond weights and the pass's activations at its peak (statistics, solve
        buffers), on the shape it receives and ``tokens`` calibration tokens: ``recipe plan``'s estimate."""
        return 0

    def kept_original_states(self, shape: ModelShape, windows: int, later_reads: bool) -> int:
        """How many one-window, one-layer sets of the original model's states the run keeps on the host while
        this step runs, when it starts on a model that still stands for its reference (``windows``: the
        calibration windows of its passes; ``later_reads``: a step after it reads the reference). By default
        one set per layer and window when ``keeps_original_states`` and a later step reads them."""
        return len(shape.layers) * windows if self.keeps_original_states and later_reads else 0

    def check_calibration(self, calibration: "CalibrationConfig") -> None:
        """Validate against the recipe's calibration settings (e.g. ``propagate``); raise ``self.fail``."""

    def check_sources(self) -> None:
        """Before anything loads (``validate``, ``apply``, ``sweep``; not the shape-only ``plan``): the step's own
        data sources, beside the calibration text, can be read; raise ``self.fail``."""

    def apply(self, session: "ModifierSession") -> dict[str, Any]:
        """Act on the whole model; return JSON-serialisable report entries."""
        raise NotImplementedError(f"{self.step_name()} is a model-scope step and must implement apply()")

    @classmethod
    def restore_extra(cls, model, config: dict[str, Any], tensors: dict[str, Any]) -> None:
        """Re-apply a non-stock addition saved with ``session.outputs.add_extra`` (see
        ``recipe_engine.records.extras``)."""
        raise NotImplementedError(f"{cls.step_name()} saved no extras it can restore")


class LayerModifier(Modifier):
    """A step that compresses layers one at a time inside the shared layer-sequential pass."""

    scope: ClassVar[Literal["model", "layer"]] = "layer"
    calibration_passes: ClassVar[int] = 1
    streams: ClassVar[bool] = True
    #: Submodules (paths inside a decoder layer) that ``compress_layer`` changes; statistics downstream
    #: of the earliest one are recollected for the next modifier (see ``recipe_engine.execution.stats``).
    modifies: ClassVar[tuple[str, ...]] = ("self_attn", "mlp")

    def target_layers(self, session: "ModifierSession") -> list[int]:
        """Current indices of the layers this step acts on."""
        raise NotImplementedError

    def statistics(self, session: "ModifierSession", layer_index: int) -> list["Statistic"]:
        """Statistics to collect on ``layer_index`` before ``compress_layer`` (may be empty)."""
        return []

    def compress_layer(self, session: "ModifierSession", layer_index: int,
                       stats: dict[str, "Statistic"]) -> dict[str, Any]:
        """Compress one layer in place (replacing its submodules is fine, the layer list is not);
        ``stats`` maps ``Statistic.key`` to the collected statistic. Returns the layer's report entry."""
        raise NotImplementedError

    def finish(self, session: "ModifierSession") -> dict[str, Any]:
        """Called once after every target layer was compressed; returns report entries."""
        return {}


def calibration_nll_bytes(shape: ModelShape, windows: int, length: int) -> int:
    """The logits of a calibration NLL over ``windows`` windows of ``length`` tokens (``LayerPipeline.final_nll``): one
    batch's in the model dtype (``shape.calibration_batch`` windows at most), and one window's at a time in
    fp32 (a copy unless the model is fp32), made contiguous for ``cross_entropy`` and its log-softmax: 8 or 12
    bytes per position and word (at 4 × 2048 tokens of a 151,936-word vocabulary in fp32: 5 GB and 2.5 GB)."""
    window = 8 + (4 if shape.dtype_bytes < 4 else 0)
    return length * shape.vocab_size * (min(windows, shape.calibration_batch) * shape.dtype_bytes + window)


def kept_original_sets(steps: list[Modifier], shapes: list[ModelShape], windows: int,
                       later_reads: bool = False) -> list[int]:
    """Per step of ``steps`` (run in order on the shapes they receive, from a model that stands for its
    reference): the one-window, one-layer sets of the original model's states kept while it runs
    (``Modifier.kept_original_states``), from the step that keeps them through the last step that reads the
    reference (``later_reads``: a step after these does). As ``Session.begin_group``/``end_group`` decide: only
    while every step before still ``preserves_outputs``."""
    kept = [0] * len(steps)
    stands_for_reference = True
    for i, (step, shape) in enumerate(zip(steps, shapes)):
        readers = [j for j in range(i + 1, len(steps)) if steps[j].needs_reference]
        if stands_for_reference:
            amount = step.kept_original_states(shape, windows, bool(readers) or later_reads)
            last = len(steps) - 1 if later_reads else max(readers, default=i)
            for j in range(i, last + 1):
                kept[j] = max(kept[j], amount)
        stands_for_reference &= step.preserves_outputs
    return kept
