"""A checkpoint's on-disk tensor names against the model's in-memory names.

transformers 5 renames and fuses some checkpoints' tensors when it loads them: a Mixtral checkpoint's per-expert
``block_sparse_moe.experts.<e>.w1.weight`` / ``w3`` become one ``mlp.experts.gate_up_proj`` per layer, and
``save_pretrained`` writes the per-expert names back (the Hub's form). Both forms load with ``from_pretrained``.
The engine reads a source checkpoint by in-memory name (the weight stream, the config/weights check), so it
asks transformers' own conversion mapping (``get_model_conversion_mapping``, its ``WeightRenaming`` and
``WeightConverter`` entries) which on-disk names make each in-memory tensor, and applies the converter's
operations: ``MergeModulelist(dim)`` stacks one pattern's tensors in expert order, ``Concatenate(dim)`` joins
the patterns. A converter with another operation is one line (the stream cannot read it; in memory it loads).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..errors import SourceError


@dataclass
class Converted:
    """The on-disk tensors that make one in-memory tensor: ``sources`` per source pattern (in the converter's
    pattern order, each in natural key order: expert 0, 1, …, 10), and the converter's ``operations``."""

    sources: list[list[str]] = field(default_factory=list)
    operations: list = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [name for group in self.sources for name in group]

    def build(self, read: Callable[[list[str]], dict[str, torch.Tensor]]) -> torch.Tensor:
        """The in-memory tensor from the on-disk ones ``read`` returns (meta tensors give its shape)."""
        # deferred: transformers' loading module is imported only for checkpoints it converts
        from transformers.core_model_loading import MergeModulelist

        tensors = read(self.names)
        state: list = [[tensors[name] for name in group] for group in self.sources]
        if not self.operations:  # a plain rename
            return state[0][0]
        for op in self.operations:
            if isinstance(op, MergeModulelist):
                state = [torch.stack(group, dim=op.dim) for group in state]
            else:  # Concatenate: checked by ``converted_names``
                state = [torch.cat(state, dim=op.dim)]
        return state[0]


def converted_names(model: nn.Module, disk_names: list[str]) -> dict[str, Converted]:
    """In-memory name → :class:`Converted` for the on-disk names transformers renames or converts when it loads
    ``model``'s checkpoint (empty when the checkpoint already has the in-memory names)."""
    # deferred: transformers' loading machinery (seconds) is needed only when a checkpoint is checked or streamed
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    owner = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    found: dict[str, Converted] = {}
    grouped: dict[str, dict[str, list[str]]] = {}
    for name in disk_names:
        target, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            if target != name:
                found[target] = Converted([[name]])
            continue
        converter = owner[pattern]
        unknown = [type(op).__name__ for op in converter.operations
                   if not isinstance(op, (MergeModulelist, Concatenate))]
        if unknown:
            raise SourceError(f"transformers converts the checkpoint tensor {name} to {target} with "
                              f"{', '.join(unknown)}, which the engine cannot read from the checkpoint; set "
                              f"stream: off")
        grouped.setdefault(target, {p: [] for p in converter.source_patterns})[pattern].append(name)
        found.setdefault(target, Converted(operations=list(converter.operations)))
    for target, by_pattern in grouped.items():
        found[target].sources = [sorted(names, key=dot_natural_key) for names in by_pattern.values()]
    return found


def converted_shapes(conversions: dict[str, Converted], shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
    """The in-memory shape each conversion gives, from the on-disk shapes (meta tensors; a conversion whose
    parts do not fit together is a one-line error naming it)."""
    result = {}
    for target, conversion in conversions.items():
        try:
            built = conversion.build(lambda names: {n: torch.empty(shapes[n], device="meta") for n in names})
        except RuntimeError as exc:
            raise SourceError(f"the checkpoint's tensors {', '.join(conversion.names[:2])}, … do not form "
                              f"{target}: {(str(exc).splitlines() or [''])[0]}") from None
        result[target] = tuple(built.shape)
    return result


def saved_names(model: nn.Module) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(in-memory name, tensor) → {on-disk name: tensor}`` as ``save_pretrained`` writes them
    (``revert_weight_conversion``: a Mixtral's fused experts as the Hub's per-expert tensors), so a streamed
    output is named as an in-memory one; views of ``tensor`` (meta tensors give the layout)."""
    # deferred: transformers' loading machinery (seconds) is needed only when an MoE checkpoint is written
    from transformers.core_model_loading import revert_weight_conversion

    return lambda name, tensor: revert_weight_conversion(model, {name: tensor})
