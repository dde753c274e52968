"""Device placement checked without an accelerator: the ``meta`` device plays the GPU.

A recipe run with ``device: meta`` puts every layer the session runs, its activations and its statistics
on ``meta`` (shapes and dtypes, no data), while the model at rest, the offloaded activations and the
outputs stay on the CPU, exactly as with ``device: cuda``. :class:`AcceleratorStandIn`, a dispatch mode,
makes that run behave like one on a GPU where placement is concerned:

* any op mixing a ``meta`` tensor with a CPU tensor raises :class:`MixedDevices`, as CUDA kernels do (a
  statistic accumulated on the host from device activations, an index or mask made on the CPU and used
  with device data, a CPU buffer fed to a device product). PyTorch itself lets many such mixes through on
  ``meta`` (``cpu_tensor.add_(meta_tensor)`` runs), so the mode checks every op. Allowed, as on CUDA: 0-dim
  CPU tensors (scalars), CPU index tensors of ``tensor[index]`` / ``index_put_``, and copies between devices;
* a copy from ``meta`` to the CPU (``.to("cpu")``, ``.cpu()``, ``copy_``, ``.item()``, ``.tolist()``) gives
  seeded random floats and zero integers, since ``meta`` holds no data: the run goes on with meaningless
  numbers, which is enough to follow every code path the data does not choose.

Code that branches on the device type as ``device.type == "cpu"`` takes its accelerator side on ``meta``
(e.g. the ridge solves of ``recipe_engine.numerics.linalg``, whose in-place CPU path is skipped), so those branches
run here too.

What it cannot catch: anything that depends on values (the device side has none and the host copies are
noise, so a branch the data would take, a NaN, a wrong result, a failed solve is not seen, and steps may
choose differently than on a GPU); speed (a host round trip per layer, a synchronising ``.item()`` in a loop, a
slow fp64 solve on the GPU: ``benchmarks/acceptance/`` measures those on a GPU); placement decided by
device *type* that treats ``meta`` unlike ``cuda`` (``device.type == "cuda"`` checks: ``torch.cuda`` memory
calls, CUDA-only kernels and dtypes, NCCL); kernels with no ``meta`` implementation (their op fails here with
NotImplementedError rather than passing); memory (``meta`` allocates nothing; the acceptance command
compares the peak GPU memory with the plan). Streamed runs are not covered: streaming marks a released
unit by its weights being on ``meta``, so ``meta`` cannot also play the accelerator there; the acceptance
command's 8B-shaped leg streams on a GPU. Nor are zero-shot evaluation, ``recipe bench``'s generation
(perplexity is: the last test) and LoRARecovery's training, which the HF Trainer places itself (on the CPU
when it finds no GPU).
transformers' own forward runs under the mode too: a placement bug there fails here the same way.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import recipe_engine
from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.recipe.registry import REGISTRY
from recipe_engine.recipe.schema import recipe_from_dict
from recipe_engine.execution.context import RunContext
from recipe_engine.execution.session import Session
from recipe_engine.execution.stats import InputCovariance
from tests.helpers import BYTE_VOCAB, CharTokenizer, byte_tokenizer, tiny_model

TEXT = "Calibration text for the placement tests, repeated to have enough tokens. " * 300
ACCELERATOR = "meta"


@pytest.fixture(autouse=True)
def meta_is_a_device(monkeypatch):
    """The engine refuses devices other than CPU and CUDA for users; here ``meta`` must pass its device check
    so that it can play the accelerator."""
    import recipe_engine.sources.devices as devices
    import recipe_engine.plan.preflight as preflight

    strict = devices.parse_device
    lenient = lambda name: torch.device(name) if str(name).startswith(ACCELERATOR) else strict(name)
    monkeypatch.setattr(devices, "parse_device", lenient)
    monkeypatch.setattr(preflight, "parse_device", lenient)
#: ops that take device data and CPU indices on CUDA (the indices are moved by the kernel)
INDEXING = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}
TRANSFERS = {"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"}


class MixedDevices(AssertionError):
    """An op got tensors on the accelerator stand-in and on the CPU."""


def _is_host_data(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() > 0


class AcceleratorStandIn(TorchDispatchMode):
    """``meta`` as the accelerator: mixed-device ops raise, copies to the host give zeros (module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops_on_accelerator = 0
        self.generator = torch.Generator().manual_seed(0)

    def host_copy(self, shape, dtype) -> torch.Tensor:
        """What a copy of ``meta`` data to the host holds: seeded normal floats (no zero norms to divide
        by), zero integers and ``False``."""
        if dtype.is_floating_point:
            return torch.randn(shape, generator=self.generator).to(dtype)
        return torch.zeros(shape, dtype=dtype)

    def __enter__(self):
        from torch.fx.experimental import _config

        # nonzero() on meta: a data-dependent shape; take every element as non-zero (meta has no data)
        self._nonzero = _config.meta_nonzero_assume_all_nonzero
        _config.meta_nonzero_assume_all_nonzero = True
        return super().__enter__()

    def __exit__(self, *exc):
        from torch.fx.experimental import _config

        _config.meta_nonzero_assume_all_nonzero = self._nonzero
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_accelerator = any(t.device.type == ACCELERATOR for t in tensors)
        self.ops_on_accelerator += on_accelerator
        if name == "aten::_local_scalar_dense" and args[0].device.type == ACCELERATOR:
            return self.host_copy((), args[0].dtype).item()
        if name == "aten::_to_copy" and args[0].device.type == ACCELERATOR and \
                torch.device(kwargs.get("device") or ACCELERATOR).type == "cpu":
            return self.host_copy(args[0].shape, kwargs.get("dtype") or args[0].dtype)
        if name in ("aten::copy_", "aten::_copy_from") and args[0].device.type == "cpu" \
                and args[1].device.type == ACCELERATOR:
            copied = self.host_copy(args[1].shape, args[1].dtype)
            return args[0].copy_(copied) if name == "aten::copy_" else copied
        if on_accelerator and name not in TRANSFERS:
            host = [t for t in tensors if _is_host_data(t)]
            if name in INDEXING:  # CPU indices are fine, CPU data is not
                data = [args[0]] + ([args[2]] if name != "aten::index" and len(args) > 2 else [])
                host = [t for t in data if isinstance(t, torch.Tensor) and _is_host_data(t)]
            if host:
                shapes = ", ".join(f"{t.device.type}{list(t.shape)}:{str(t.dtype).removeprefix('torch.')}"
                                   for t in tensors)
                raise MixedDevices(f"{name} mixes the accelerator and the host: {shapes}")
        return func(*args, **kwargs)


def example_recipe(tmp_path, name: str, device: str = ACCELERATOR) -> dict:
    data = tmp_path / "cal.txt"
    data.write_text(TEXT)
    return {"version": 1, "name": f"placement-{name}", "model": "tiny", "device": device,
            "output": str(tmp_path / "out"),
            "calibration": {"dataset": str(data), "samples": 4, "seq_len": 32, "batch_size": 2},
            "modifiers": [STAND_IN_PARAMS.get(name, step) for step in REGISTRY.get(name).example_steps()]}


#: Steps whose solve needs data: ``meta`` holds none (a Gram copied to the host is seeded noise, not positive
#: definite), so ReplaceMe's Cholesky least squares cannot run here; its cosine objective (Adam on the
#: session's device) exercises the same capture pass and a device-side fit.
STAND_IN_PARAMS = {"ReplaceMe": {"ReplaceMe": {"n": 1, "objective": "cosine", "adam": {"epochs": 1}}}}


# -- the stand-in itself ---------------------------------------------------------------------------
def test_the_stand_in_raises_on_host_data_and_allows_what_cuda_allows():
    with AcceleratorStandIn():
        x = torch.randn(4, 3, device=ACCELERATOR)
        gram = torch.zeros(3, 3, dtype=torch.float64)  # on the host by mistake
        with pytest.raises(MixedDevices, match="aten::add_"):
            gram.add_(x.double().T @ x.double())
        with pytest.raises(MixedDevices, match="aten::mm"):
            torch.ones(2, 4) @ x
        with pytest.raises(MixedDevices, match="aten::index_select"):
            x.index_select(0, torch.tensor([0, 1]))
        assert x[torch.tensor([0, 2])].device.type == ACCELERATOR  # CPU indices: fine on CUDA too
        assert (x * torch.tensor(2.0)).device.type == ACCELERATOR  # a CPU scalar: fine
        assert x.cpu().shape == (4, 3) and x.cpu().device.type == "cpu"
        assert x.max(dim=0).indices.tolist() == [0, 0, 0]


def test_a_statistic_kept_on_the_host_fails_a_session_run():
    """The harness finds the bug class it is for: a statistic whose sums live on the host."""
    class HostGram(InputCovariance):
        def update(self, inputs, output):
            x = inputs.reshape(-1, inputs.shape[-1]).double()
            if self.gram is None:
                self.gram = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)  # no device=
            self.gram.add_(x.T @ x)

    model = tiny_model(num_hidden_layers=2)
    recipe = recipe_from_dict(example_recipe_dict())
    session = Session(RunContext(None, adapter_for(model.config), recipe.calibration, torch.device(ACCELERATOR)),
                      model, torch.randint(0, 128, (4, 16))).view
    with AcceleratorStandIn():
        inputs = session.capture_inputs()
        assert inputs[0].device.type == "cpu"  # offloaded between layers
        good = InputCovariance("mlp.down_proj")
        with session.session.residency.using(0):
            session.run_layer(session.layers[0], inputs, hooks=[good])
        assert good.gram.device.type == ACCELERATOR and good.gram.dtype == torch.float64
        with session.session.residency.using(0), pytest.raises(MixedDevices, match="aten::add_"):
            session.run_layer(session.layers[0], inputs, hooks=[HostGram("mlp.down_proj")])


def example_recipe_dict() -> dict:
    return {"version": 1, "name": "placement", "model": "tiny", "output": "unused",
            "calibration": {"dataset": "unused.txt", "samples": 4, "seq_len": 16, "batch_size": 2},
            "modifiers": ["FuseNorm"]}


# -- every modifier, on the stand-in -------------------------------------------------------------------
@pytest.mark.parametrize("name", REGISTRY.names())
def test_every_modifier_places_its_tensors_on_the_session_device(tmp_path, name):
    """Each modifier's example recipe, run in memory with ``device: meta`` under the stand-in: no op mixes
    the accelerator with host data, and the layers ran on the accelerator (evaluation off: its own
    device handling is the evaluation code's)."""
    stock = REGISTRY.get(name).stock_output
    model = tiny_model(num_hidden_layers=6, **({} if stock else {"vocab_size": BYTE_VOCAB}))
    tokenizer = CharTokenizer() if stock else byte_tokenizer()
    mode = AcceleratorStandIn()
    with mode:
        _, report = recipe_engine.apply(example_recipe(tmp_path, name), model=model, tokenizer=tokenizer,
                                        write=False, progress=False)
    assert report.device == ACCELERATOR
    # FuseNorm folds norms, Quantize rounds layer by layer, on the host (no calibration); LoRARecovery
    # trains through the HF Trainer, which places the model itself (on CPU when no GPU is found)
    if name not in ("FuseNorm", "Quantize", "LoRARecovery"):
        assert mode.ops_on_accelerator > 100, mode.ops_on_accelerator
    assert all(p.device.type == "cpu" for p in model.parameters())  # back on the host at rest



def test_evaluation_places_its_tensors_on_the_session_device(tmp_path):
    """Perplexity before and after, in memory, under the stand-in (what the acceptance command's SmolLM2
    leg runs on a GPU)."""
    recipe = example_recipe(tmp_path, "NystromMLP")
    recipe["evaluate"] = {"perplexity": {"dataset": str(tmp_path / "cal.txt"), "split": "all", "seq_len": 32,
                                         "limit": 2}}
    mode = AcceleratorStandIn()
    with mode:
        _, report = recipe_engine.apply(recipe, model=tiny_model(num_hidden_layers=6, vocab_size=BYTE_VOCAB),
                                        tokenizer=byte_tokenizer(), write=False, progress=False)
    assert report.evaluation.before.perplexity.windows == report.evaluation.after.perplexity.windows == 2
