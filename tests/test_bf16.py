"""bf16 end to end on CPU, the stand-in for a GPU run: a bf16 checkpoint through every registered modifier.

For each modifier's example recipe, the same tiny checkpoint (saved in fp32) is compressed twice, with
``dtype: bfloat16`` and with ``dtype: float32``:

* the written safetensors hold bf16 for every floating tensor of the bf16 run (fp32 for the fp32 run);
* every statistic is accumulated in fp32/fp64: each ``Statistic``'s ``sums`` are fp32/fp64 after every
  ``update``, and no arithmetic inside a statistic update or a whole-model pass's ``visit`` callback (where
  model-scope steps accumulate similarities, Block Influence, NLL) produces a bf16 tensor: only data
  movement (views, indexing, copies, casts) may touch bf16 there;
* the choices are the fp32 run's (which original layers each output layer stands for, parameter count);
* the outputs are close. The yardstick is ``dense_gap``, the RMS difference of the dense checkpoint's logits
  loaded in bf16 and in fp32: rounding every weight and activation to bf16 (unit roundoff 2⁻⁸) is the floor
  of any bf16 run. A step whose result is continuous in its statistics (every step but the quantizers)
  stays within 5 × ``dense_gap`` + 5 % of its own compression error (RMS logit change vs the dense model)
  of the fp32 result: its statistics see bf16 activations and its fp64 solutions are rounded to bf16 when
  written, each about one ``dense_gap`` again, compounding over the layers after it (measured on these
  models: at most 4.1 × ``dense_gap``, under 5 % of the compression error). The quantizers (GPTQ, Quantize)
  are not continuous: bf16 inputs flip a rounding decision wherever a weight lies near a grid midpoint and
  GPTQ's error feedback carries each flip on, so their bf16 and fp32 results are different roundings of one
  model (measured: 22.5 × ``dense_gap`` apart for GPTQ); what must hold is the quality, the bf16 result's
  error at most 1.3 × the fp32 result's + 5 × ``dense_gap`` (measured: GPTQ 1.21 ×, Quantize 1.06 ×).
* the written weights: ``model*.safetensors``. LinearPatch's patch matrices (``recipe_extras.safetensors``,
  cast to the activations' dtype when applied) are kept in fp32.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

import recipe_engine
from recipe_engine.recipe.registry import REGISTRY
from recipe_engine.execution.pipeline import LayerPipeline
from recipe_engine.execution.stats import Statistic
from tests.helpers import BYTE_VOCAB, random_tokens, save_tiny_model

TEXT = "Calibration text for the bf16 tests, repeated to have enough tokens. " * 300
LOW = (torch.bfloat16, torch.float16)
#: steps whose result is not continuous in their input (a weight at a grid midpoint rounds either way)
QUANTIZERS = ("GPTQ", "Quantize")
#: ops that move or reinterpret data without arithmetic: allowed on bf16 tensors inside statistics
MOVES = {"aten::" + n for n in (
    "_to_copy", "copy_", "clone", "detach", "view", "_unsafe_view", "reshape", "slice", "select", "t",
    "transpose", "permute", "expand", "unsqueeze", "squeeze", "as_strided", "index", "index_select",
    "contiguous", "alias", "lift_fresh", "empty_like", "empty", "split", "split_with_sizes", "unbind",
    "chunk", "narrow", "cat", "stack", "flatten", "_reshape_alias", "unfold", "gather", "masked_select")}


class LowPrecisionArithmetic(TorchDispatchMode):
    """Raises on any op other than data movement whose output is a bf16/fp16 tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        if name not in MOVES and any(isinstance(o, torch.Tensor) and o.dtype in LOW for o in outputs):
            raise AssertionError(f"{name} computed in {[o.dtype for o in outputs if isinstance(o, torch.Tensor)]} "
                                 f"inside a statistic")
        return out


def all_statistic_classes() -> list[type]:
    found, todo = [], [Statistic]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if "update" in vars(c)]


@contextlib.contextmanager
def statistics_checked(monkeypatch, seen: list[str]):
    """Every statistic update and every layer-pass visit runs under :class:`LowPrecisionArithmetic`; sums
    are checked to be fp32/fp64 after each update."""
    for cls in all_statistic_classes():
        original = vars(cls)["update"]

        def update(self, inputs, output, _original=original):
            with LowPrecisionArithmetic():
                _original(self, inputs, output)
            for name in type(self).sums or ():
                value = getattr(self, name)
                if isinstance(value, torch.Tensor):
                    assert value.dtype in (torch.float32, torch.float64, torch.int64), (self.key, name, value.dtype)
            seen.append(self.key.split(":")[0])

        monkeypatch.setattr(cls, "update", update)
    layer_pass = LayerPipeline.layer_pass

    def checked_pass(self, visit, *args, **kwargs):
        def guarded(*a):
            seen.append("visit")
            with LowPrecisionArithmetic():
                return visit(*a)
        return layer_pass(self, guarded, *args, **kwargs)

    monkeypatch.setattr(LayerPipeline, "layer_pass", checked_pass)
    yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-fp32")
    save_tiny_model(directory, num_hidden_layers=6)
    data = directory / "cal.txt"
    data.write_text(TEXT)
    return directory


def run(checkpoint, tmp_path, name: str, dtype: str):
    recipe = {"version": 1, "name": f"bf16-{name}", "model": str(checkpoint), "dtype": dtype, "device": "cpu",
              "output": str(tmp_path / dtype),
              "calibration": {"dataset": str(checkpoint / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2},
              "modifiers": REGISTRY.get(name).example_steps()}
    _, report = recipe_engine.apply(recipe, progress=False)
    return tmp_path / dtype, report


def stored_dtypes(directory) -> set[torch.dtype]:
    dtypes = set()
    for file in directory.glob("model*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                tensor = handle.get_slice(key)
                dtypes.add(getattr(torch, {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "I64": "int64",
                                           "I32": "int32", "I8": "int8", "U8": "uint8"}[tensor.get_dtype()]))
    return dtypes


def logits(directory, tokens) -> torch.Tensor:
    model, _ = recipe_engine.load_model(str(directory), "float32")
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("name", REGISTRY.names())
def test_bf16_run_matches_fp32_with_full_precision_statistics(checkpoint, tmp_path, monkeypatch, name):
    seen: list[str] = []
    with statistics_checked(monkeypatch, seen):
        low, low_report = run(checkpoint, tmp_path, name, "bfloat16")
    monkeypatch.undo()
    high, high_report = run(checkpoint, tmp_path, name, "float32")
    floating = lambda dtypes: {d for d in dtypes if d.is_floating_point}  # a packed quantizer stores ints too
    assert floating(stored_dtypes(low)) == {torch.bfloat16}, name
    assert floating(stored_dtypes(high)) == {torch.float32}, name
    assert low_report.dtype == "bfloat16"
    assert low_report.after.layer_origin == high_report.after.layer_origin
    assert low_report.after.parameters == high_report.after.parameters
    if name not in ("FuseNorm", "Quantize", "LoRARecovery", "LaCo"):  # these collect no calibration statistic
        assert seen, f"{name}: no statistic or layer pass was checked"
    tokens = random_tokens(2, 32, vocab=BYTE_VOCAB, seed=1)
    dense = logits(checkpoint, tokens)
    model, _ = recipe_engine.load_model(str(checkpoint), "bfloat16")
    with torch.no_grad():
        dense_gap = (model(tokens).logits.float() - dense).abs().max()
    low_logits, high_logits = logits(low, tokens), logits(high, tokens)
    rms = lambda t: float(t.pow(2).mean().sqrt())
    gap, dense_gap = rms(low_logits - high_logits), rms(model(tokens).logits.float() - dense)
    err_low, err_high = rms(low_logits - dense), rms(high_logits - dense)
    if REGISTRY.get(name).__name__ in QUANTIZERS:
        assert err_low <= 1.3 * err_high + 5 * dense_gap, (name, err_low, err_high, dense_gap)
    else:
        assert gap <= 5 * dense_gap + 0.05 * err_high, (name, gap, dense_gap, err_high)


def test_the_check_catches_a_statistic_summed_in_bf16(monkeypatch):
    class BadGram(Statistic):
        sums = ("gram",)

        def update(self, inputs, output):
            x = inputs.reshape(-1, inputs.shape[-1])
            self.gram = x.T @ x  # in the activations' dtype

    class GoodGram(BadGram):
        def update(self, inputs, output):
            x = inputs.reshape(-1, inputs.shape[-1]).to(torch.float64)
            self.gram = x.T @ x

    x = torch.randn(2, 3, 4).to(torch.bfloat16)
    with statistics_checked(monkeypatch, []):
        GoodGram("").update(x, None)
        with pytest.raises(AssertionError, match="aten::mm computed in"):
            BadGram("").update(x, None)
