"""What a run produces besides the model's weights: non-stock extras, files for the output directory, and the
quantization records of packed linears. The runner owns one :class:`RunOutputs` per run and hands it to the
session; steps add to it (``session.outputs``), the writer and the resume checkpoints read it.
"""
from __future__ import annotations

import csv
import io
from typing import Any, Callable

import torch
from torch import nn

from ..numerics.quantization import Grid, QuantizedLinear


class RunOutputs:
    """The extras collector of one run (or of one branch of it, until the branch is adopted)."""

    def __init__(self) -> None:
        #: Non-stock additions saved beside the checkpoint (``recipe_engine.records.extras``), in step order.
        self.extras: list[dict[str, Any]] = []
        #: Files for the output directory, by name (``dir/file`` at most one level down): bytes, or a
        #: function drawing them, called once the files are wanted (``artifacts``).
        self._artifacts: dict[str, bytes | Callable[[], bytes]] = {}
        #: ``(module, parameter)`` of the weights that lie on a quantization grid (a linear's ``weight``, an MoE
        #: layer's expert tensors); the writer packs them.
        self.quantized: dict[tuple[nn.Module, str], QuantizedLinear] = {}
        #: id of a step object → its label in row logs, ``"<index> <Name>"`` (:meth:`label_steps`).
        self.step_labels: dict[int, str] = {}

    def label_steps(self, steps: list[tuple[int, Any]]) -> None:
        """Name the ``(recipe index, step)`` pairs about to run, for the ``step`` column of row logs."""
        self.step_labels.update({id(step): f"{index} {step.step_name()}" for index, step in steps})

    def add_extra(self, modifier: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Record a non-stock addition to save beside the checkpoint (see ``recipe_engine.records.extras``)."""
        self.extras.append({"modifier": modifier, "config": config, "tensors": tensors})

    @property
    def artifacts(self) -> dict[str, bytes]:
        """The files for the output directory, by name; a file given as a function is drawn now, once."""
        return {name: self._drawn(name) for name in self._artifacts}

    def _drawn(self, name: str) -> bytes | None:
        data = self._artifacts.get(name)
        if callable(data):
            data = self._artifacts[name] = data()
        return data

    def add_artifact(self, filename: str, data: bytes | Callable[[], bytes]) -> None:
        """A file (e.g. a PNG heatmap) to write into the output directory beside the checkpoint, or into
        one subdirectory of it (``"lora_adapter/adapter_model.safetensors"``). ``data`` may be a function
        returning the bytes: it is called only when the files are written or checkpointed (a plot drawn
        for a BestOf alternative that loses, or a run that writes nothing, is never drawn)."""
        parts = filename.split("/")
        if len(parts) > 2 or any(not part or part.startswith(".") for part in parts):
            raise ValueError(f"artifact name must be a file name or dir/file name, got {filename!r}")
        self._artifacts[filename] = data

    def add_rows(self, filename: str, rows: list[dict[str, Any]], step: Any = None) -> None:
        """Append ``rows`` to a CSV file of the output directory (a per-layer log): the columns are the first
        row's keys, and every later row must have the same. With ``step`` (the step object adding them) each
        row starts with a ``step`` column, ``"<index> <Name>"``, so two steps writing one log stay apart.
        The file is kept as an artifact, so resume checkpoints and branches carry it like any other."""
        if not filename.endswith(".csv"):
            raise ValueError(f"a row log is a .csv file, got {filename!r}")
        if step is not None:
            label = self.step_labels.get(id(step), step.step_name())
            rows = [{"step": label, **row} for row in rows]
        old = self._drawn(filename)
        table = list(csv.reader(io.StringIO(old.decode()))) if old else []
        columns = table[0] if table else list(rows[0]) if rows else []
        for row in rows:
            if list(row) != columns:
                raise ValueError(f"{filename}: row columns {list(row)} differ from {columns}")
            table.append(["" if row[c] is None else row[c] for c in columns])
        if not table:
            return
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerows(table if old else [columns, *table])
        self.add_artifact(filename, text.getvalue().encode())

    def rows(self, filename: str, step: Any = None) -> list[dict[str, str]]:
        """The rows of a CSV log added by :meth:`add_rows` (with ``step``: only those that step added), as
        strings; a resumed run reads the rows its checkpoint carried too."""
        data = self._drawn(filename)
        rows = list(csv.DictReader(io.StringIO(data.decode()))) if data else []
        if step is None:
            return rows
        label = self.step_labels.get(id(step), step.step_name())
        return [row for row in rows if row.get("step") == label]

    def mark_quantized(self, linear: nn.Module, grid: Grid, scale: torch.Tensor, zero: torch.Tensor,
                       format: str, parameter: str = "weight") -> None:
        """Record that ``linear``'s weight (or its tensor ``parameter``: an MoE layer's stacked experts, scale and
        zero ``[experts, rows, groups]``) lies on ``grid`` with per-group ``[rows, groups]`` ``scale`` and
        ``zero`` (codes ``0 … 2^b − 1``): the checkpoint stores it packed in ``format`` (a checkpoint
        format of ``recipe_engine.formats``). One format per checkpoint; each linear has its own grid (a
        step's ``overrides``)."""
        self.restore_quantized(linear, QuantizedLinear(grid, scale.detach().to("cpu", torch.float32),
                                                       zero.detach().to("cpu", torch.int16), format, parameter))

    def restore_quantized(self, linear: nn.Module, record: QuantizedLinear) -> None:
        """Record ``linear``'s quantization (of ``record.parameter``) as given (a resumed run's record, kept as
        the same object)."""
        other = next((kept for kept in self.quantized.values() if kept.format != record.format), None)
        if other is not None:
            raise RuntimeError(f"one checkpoint format per checkpoint: {record.format} after {other.format}")
        self.quantized[(linear, record.parameter)] = record

    def copy_for(self, copies: dict[int, Any]) -> "RunOutputs":
        """The outputs of a branch over a copy of the model (``copies``: ``copy.deepcopy``'s memo of that
        copy): the extras and files so far, and the quantization records re-keyed to the copied linears, so
        that the branch starts from everything the run has produced until now."""
        copied = RunOutputs()
        copied.extras, copied._artifacts = list(self.extras), dict(self._artifacts)
        copied.step_labels = dict(self.step_labels)
        copied.quantized = {(copies[id(linear)], parameter): record
                            for (linear, parameter), record in self.quantized.items() if id(linear) in copies}
        return copied

    def adopt(self, branch: "RunOutputs") -> None:
        """Take a branch's outputs (``ModifierSession.adopt``); the branch started from a copy of these
        (:meth:`copy_for`), so its extras, files and quantization records replace them."""
        self.extras, self._artifacts, self.quantized = (list(branch.extras), dict(branch._artifacts),
                                                        dict(branch.quantized))
