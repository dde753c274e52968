"""The activation store (``recipe_engine/execution/activations.py``) is the one place a calibration batch moves
between host and device in a pass.

The rule, checked at run time rather than by reading the code: every copy between the host and the device of
a floating-point tensor shaped like a calibration batch's activations, ``[batch_size, seq_len, ...]`` with at
least three dimensions (the hidden states entering or leaving a layer, the rotary embeddings among the layers' keyword
arguments), is made by a line of ``activations.py``, or inside the model's own forward (transformers code).
The line that made the copy is the innermost stack frame outside PyTorch; a frame of any other engine or
modifier module fails the test with its file and line. Every registered modifier's example recipe runs with
``device: meta`` under ``tests/test_device_placement.py``'s accelerator stand-in, so the activations live on the
host (``offload: auto`` on a device other than CUDA) and every layer runs on the "device": each batch really
crosses. A static rule (a grep for ``.to(`` on some variable names) would miss a renamed variable and flag
``.to(dtype)``; this one sees the copies themselves. Out of its reach: streamed runs (streaming uses ``meta`` for
released weights), a step's own per-batch data that is not activations (token masks, which are boolean;
selected rows, which are 2-D), and moves between two accelerators.
"""
from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

import recipe_engine
from recipe_engine.recipe.registry import REGISTRY
from tests.helpers import BYTE_VOCAB, CharTokenizer, byte_tokenizer, tiny_model
from tests.test_device_placement import ACCELERATOR, AcceleratorStandIn, example_recipe, meta_is_a_device  # noqa: F401

BATCH, SEQ_LEN = 2, 32  # example_recipe's calibration
COPIES = {"aten::_to_copy", "aten::copy_", "aten::_copy_from"}
TORCH = str(Path(torch.__file__).parent)
STORE = str(Path(recipe_engine.__file__).parent / "execution" / "activations.py")


def _crosses(func, args, kwargs) -> torch.Tensor | None:
    """The batch-shaped floating-point tensor a host ↔ device copy moves, or None."""
    name = func._schema.name
    if name not in COPIES:
        return None
    if name == "aten::_to_copy":
        source, target = args[0], torch.device(kwargs.get("device") or args[0].device)
    else:
        source, target = args[1], args[0].device
    if (source.device.type == "cpu") == (target.type == "cpu"):
        return None
    batch_shaped = source.dim() >= 3 and tuple(source.shape[:2]) == (BATCH, SEQ_LEN)
    return source if batch_shaped and source.is_floating_point() else None


class WatchedMoves(AcceleratorStandIn):
    """The stand-in, recording the line behind every batch-shaped host ↔ device copy."""

    def __init__(self):
        super().__init__()
        self.movers: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _crosses(func, args, kwargs or {}) is not None:
            caller = next(frame for frame in reversed(traceback.extract_stack())
                          if not frame.filename.startswith(TORCH) and frame.name != "__torch_dispatch__")
            self.movers[f"{caller.filename}:{caller.lineno}"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _engine_movers(movers: Counter) -> dict[str, int]:
    engine = str(Path(recipe_engine.__file__).parent)
    return {line: n for line, n in movers.items() if line.startswith(engine) and not line.startswith(STORE + ":")}


@pytest.mark.parametrize("name", REGISTRY.names())
def test_only_the_activation_store_moves_calibration_batches(tmp_path, name):
    stock = REGISTRY.get(name).stock_output
    model = tiny_model(num_hidden_layers=6, **({} if stock else {"vocab_size": BYTE_VOCAB}))
    mode = WatchedMoves()
    with mode:
        recipe_engine.apply(example_recipe(tmp_path, name), model=model,
                            tokenizer=CharTokenizer() if stock else byte_tokenizer(), write=False, progress=False)
    assert _engine_movers(mode.movers) == {}
    if name not in ("FuseNorm", "Quantize", "LoRARecovery"):  # no calibration pass, or the HF Trainer's own
        assert any(line.startswith(STORE + ":") for line in mode.movers), mode.movers


def test_the_watch_sees_a_batch_moved_elsewhere():
    """The rule catches what it is for: a batch moved by a line outside the store."""
    mode = WatchedMoves()
    with mode:
        torch.zeros(BATCH, SEQ_LEN, 8).to(ACCELERATOR)
        torch.zeros(BATCH, SEQ_LEN).to(ACCELERATOR)  # 2-D: not activations
        torch.zeros(BATCH, SEQ_LEN, 1, dtype=torch.bool).to(ACCELERATOR)  # a token mask
        torch.zeros(BATCH, SEQ_LEN, 8).to(torch.float64)  # no device change
    (line,) = mode.movers
    assert line.startswith(__file__ + ":")
