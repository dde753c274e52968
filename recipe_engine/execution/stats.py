"""Per-layer calibration statistics, accumulated by forward hooks in fp64.

A :class:`Statistic` names the module it hooks by its path inside a decoder layer (``""`` is the layer
itself) and accumulates over calibration batches. Modifiers may define their own subclasses in their file;
the engine only calls ``update`` and reads ``key``/``position``.

Positions order what a statistic depends on inside a layer (0: layer input and q/k/v inputs,
1: ``o_proj`` input, 2: MLP input, 3: ``down_proj`` input, 4: layer output), read from the architectures'
role maps (``recipe_engine.architectures.adapters``); a change to a module at
position p invalidates statistics at positions > p.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ..architectures.adapters import ADAPTERS

#: Dataflow position of every module path of every supported architecture (``ArchitectureAdapter.positions``:
#: the role maps agree on a path's position), plus the layer itself.
POSITIONS = {**{path: pos for adapter in ADAPTERS.values() for path, pos in adapter.positions().items()}, "": 4}


def position(module: str) -> int:
    """Dataflow position of a module path; unknown paths count as the layer output (always stale)."""
    return POSITIONS.get(module, 4)


def change_position(module: str) -> int:
    """Position of a changed module; unknown paths invalidate everything."""
    return POSITIONS.get(module, -1)


class Statistic:
    """Base class: ``update(inputs, output)`` is called once per calibration batch.

    ``sums`` names the attributes that are sums over batches (tensors, numbers, or None when nothing was
    collected): a data-parallel run all-reduces exactly these in fp64 (``recipe_engine.execution.distributed``); ``()``
    declares a per-batch scratch value with nothing to reduce; ``None`` (undeclared) cannot be split over
    ranks. ``batch`` is the index of the calibration batch being run, set by the session before each batch
    (for statistics that pair a batch with per-batch targets).
    """

    sums: ClassVar[tuple[str, ...] | None] = None
    batch: int = 0
    released: bool = False

    def __init__(self, module: str):
        self.module = module

    def release(self) -> None:
        """Free the sums now: the caller is done with them (a merged 8B MLP's Gram is 6.6 GB). The session
        drops a released statistic from its cache, so a later step that needs it collects it again."""
        for name in self.sums or ():
            setattr(self, name, None)
        self.released = True

    @property
    def key(self) -> str:
        return f"{type(self).__name__}:{self.module}"

    @property
    def position(self) -> int:
        return position(self.module)

    def update(self, inputs: torch.Tensor, output: torch.Tensor) -> None:
        raise NotImplementedError


#: rows of the Gram computed per product in :meth:`InputCovariance.update`
ROW_PANEL = 512


class InputCovariance(Statistic):
    """Gram matrix ``G = Σ_t x_t x_tᵀ`` (fp64) of a module's input over all calibration tokens.

    ``count`` is the number of tokens; ``covariance = G / count`` (uncentred second moment).
    ``products``: dtype of each batch's ``XᵀX`` (sums over batches are fp64 either way); fp32 halves the
    cost for steps that tolerate ~1e-6 relative error per entry (GPTQ's reference code keeps H in fp32).
    Only the blocks on and above the diagonal are summed (about half the products of a full ``XᵀX``); the
    lower triangle is mirrored from them when ``gram`` is read (and overwritten again by the next read).
    """

    sums = ("gram", "count")

    def __init__(self, module: str, products: torch.dtype = torch.float64):
        super().__init__(module)
        self.products = products
        self._gram: torch.Tensor | None = None
        self._mirrored = True
        self.count = 0

    @property
    def key(self) -> str:
        return super().key if self.products == torch.float64 else f"{super().key}@{self.products}"

    @property
    def gram(self) -> torch.Tensor | None:
        """The symmetric sum (its lower triangle filled from the upper one on the first read after a batch)."""
        if not self._mirrored:
            width = self._gram.shape[0]
            for start in range(0, width, ROW_PANEL):
                stop = min(start + ROW_PANEL, width)
                self._gram[stop:, start:stop] = self._gram[start:stop, stop:].T
            self._mirrored = True
        return self._gram

    @gram.setter
    def gram(self, value: torch.Tensor | None) -> None:
        self._gram, self._mirrored = value, True

    def update(self, inputs: torch.Tensor, output: torch.Tensor) -> None:
        """``G += XᵀX`` on and above the diagonal, in row panels of ``ROW_PANEL`` (panel ``[a, b)`` adds
        ``X[:, a:b]ᵀ X[:, a:]``), each accumulated by ``addmm_`` into the fp64 sum's own rows: no product
        buffer and never a second ``n × n`` matrix (a merged 8B MLP: 6.6 GB saved)."""
        x = inputs.reshape(-1, inputs.shape[-1]).to(self.products)
        width = x.shape[1]
        if self._gram is None:
            self._gram = torch.zeros(width, width, dtype=torch.float64, device=x.device)
        for start in range(0, width, ROW_PANEL):
            stop = min(start + ROW_PANEL, width)
            rows = self._gram[start:stop, start:]
            if x.dtype == torch.float64:
                rows.addmm_(x[:, start:stop].T, x[:, start:])
            else:
                rows.add_(x[:, start:stop].T @ x[:, start:])
        self._mirrored = False
        self.count += x.shape[0]

    @property
    def covariance(self) -> torch.Tensor:
        if self.gram is None:
            raise RuntimeError(f"{self.key}: no batch was collected")
        return self.gram / self.count
