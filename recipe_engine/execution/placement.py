"""Where calibration activations live between layers (``calibration.offload``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..plan.estimates import MemoryPlan

#: Share of the device's free memory that activations, a step's working memory and the layers in use may take.
DEVICE_SHARE = 0.8


def largest_layer_bytes(layers: nn.ModuleList) -> int:
    """Bytes of the largest decoder layer's parameters (meta tensors count their would-be size)."""
    return max((sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers), default=0)


def offload_activations(offload: bool | str, device: torch.device, memory: MemoryPlan, layer_bytes: int) -> bool:
    """``calibration.offload`` resolved: ``true``/``false`` as given; ``auto`` keeps activations on an
    accelerator when ``recipe plan``'s activation estimate, its largest step working memory and four of the
    largest layer (the layer in use, its original, a merged layer twice as wide) fit in ``DEVICE_SHARE`` of
    the device's free memory, so a pass makes no host round trip per batch; else on the host. On CPU the
    device is the host: true."""
    if offload != "auto":
        return bool(offload)
    if device.type != "cuda":
        return True
    need = memory.activations_bytes + max((s.working_bytes for s in memory.steps), default=0) \
        + 4 * layer_bytes
    free, _total = torch.cuda.mem_get_info(device)
    return need > DEVICE_SHARE * free
