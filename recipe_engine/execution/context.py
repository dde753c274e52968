"""The facts of one recipe run that every session of it shares: :class:`RunContext`.

A run has several sessions: the one over the model being compressed, the original model's (``reference``),
a combinator's branches and a perplexity run's sibling over other windows. They differ in model, calibration
windows and weight stream, and share everything here: the tokenizer and architecture adapter, the calibration
settings, the device and where activations live, the progress display, the data-parallel ranks, the pass
counter, the timings clock, and whether the result must be a stock checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..architectures.adapters import ArchitectureAdapter
from ..recipe.schema import CalibrationConfig
from ..system.progress import Progress
from .distributed import Parallel
from .modifier_session import PassCounter
from .timings import Timings


@dataclass
class RunContext:
    """What a session shares with its siblings (``Session.sibling``: the reference session, branches)."""

    tokenizer: Any
    adapter: ArchitectureAdapter
    #: The recipe's calibration settings (``calibration:``).
    config: CalibrationConfig
    device: torch.device
    #: The progress display (None: none shown).
    progress: Progress | None = None
    #: This process's rank in a data-parallel run (``recipe_engine.execution.distributed``); None: one process.
    parallel: Parallel | None = None
    #: Calibration passes made so far by every session of the run (``recipe plan`` predicts them).
    passes: PassCounter | None = None
    #: The run's phase clock and timings log (``recipe_engine.execution.timings``).
    timings: Timings | None = None
    #: ``calibration.offload`` resolved (the runner decides ``auto``; None: true unless the recipe says false):
    #: the activations live on the host between layers. The recipe's own value is left as written.
    offload: bool | None = None
    #: The run's result must be a stock checkpoint (the recipe exports it): ``ModelShape.stock_only``.
    stock_only: bool = False

    def __post_init__(self) -> None:
        if self.progress is None:
            self.progress = Progress(enabled=False)
        self.passes = self.passes or PassCounter()
        self.timings = self.timings if self.timings is not None else Timings()
        if self.parallel is None:
            self.parallel = Parallel(device=self.device)
        if self.offload is None:
            self.offload = self.config.offload is not False

    @property
    def storage(self) -> torch.device:
        """Where calibration activations live between layers (``calibration.offload``, resolved)."""
        return torch.device("cpu") if self.offload else self.device


@dataclass
class LayerWork:
    """Layer runs over the calibration batches and batches run through (part of) a layer, by one session (a
    data-parallel rank: its share); ``StagedLayer`` counts its own."""

    runs: int = 0
    batches: int = 0

    def count(self, runs: int = 0, batches: int = 0) -> None:
        self.runs += runs
        self.batches += batches
