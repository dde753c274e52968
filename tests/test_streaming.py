"""Streamed sessions (``stream: on``): the model is a meta-device skeleton whose layers are read from the
checkpoint on disk and staged when changed. The streamed run must write exactly the weights of the
in-memory run (``stream: off``) for every registered modifier, on sharded and single-file sources."""
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import recipe_engine
from recipe_engine.checkpoint.writer import write_checkpoint
from recipe_engine.errors import RecipeError
from recipe_engine.recipe.registry import REGISTRY
from recipe_engine.checkpoint.reader import CheckpointReader, is_materialized
from recipe_engine.records.fingerprints import WeightsFingerprint, weights_fingerprint
from tests.helpers import (BYTE_VOCAB, byte_tokenizer, random_tokens, reference_fingerprint, save_tiny_model,
                           shared_data, tiny_model)

TEXT = "Streaming calibration text, repeated so that there are enough tokens for every window. " * 200


def saved_model(directory, model_type="llama", shard="40KB", **overrides):
    """A tiny random model saved as a (sharded, by default) checkpoint with a reloadable tokenizer."""
    return save_tiny_model(directory, model_type, max_shard_size=shard, num_hidden_layers=6, **overrides)


def recipe(tmp_path, model_dir, steps, stream, name):
    data = tmp_path / "cal.txt"
    data.write_text(TEXT)
    return {"version": 1, "name": name, "model": str(model_dir), "output": str(tmp_path / name),
            "stream": stream, "calibration": {"dataset": str(data), "samples": 4, "seq_len": 32, "batch_size": 2},
            "modifiers": steps}


def weights(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        if file.name != "recipe_extras.safetensors":
            tensors.update(load_file(file))
    return tensors


def run_both(tmp_path, model_dir, steps):
    outputs = []
    for stream in ("off", "on"):
        _, report = recipe_engine.apply(recipe(tmp_path, model_dir, steps, stream, f"out-{stream}"),
                                        progress=False)
        assert report.streamed is (stream == "on")
        outputs.append(tmp_path / f"out-{stream}")
    return outputs, report


def assert_same_weights(memory_dir, streamed_dir, atol: float = 0.0):
    expected, got = weights(memory_dir), weights(streamed_dir)
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("name", REGISTRY.names())
def test_every_modifier_streamed_equals_in_memory(tmp_path, name):
    model_dir = tmp_path / "model"
    saved_model(model_dir)
    if REGISTRY.get(name).refuses_streaming:  # declared: refused in one line before anything loads
        with pytest.raises(RecipeError, match=f"{name}\\): field 'stream': cannot run streamed"):
            recipe_engine.apply(recipe(tmp_path, model_dir, REGISTRY.get(name).example_steps(), "on", "out-on"),
                                progress=False)
        assert not (tmp_path / "out-on").exists()
        return
    (memory, streamed), report = run_both(tmp_path, model_dir, REGISTRY.get(name).example_steps())
    # LoRA training (on the whole model, materialized) amplifies last-bit differences of BLAS on the
    # memory-mapped weights over its steps; every other step is bit-exact
    trained = name == "LoRARecovery"
    assert_same_weights(memory, streamed, atol=1e-3 if trained else 0.0)
    assert not (streamed / ".staging").exists() and not list(tmp_path.glob(".out-on.tmp-*"))
    assert json.loads((streamed / "config.json").read_text())["num_hidden_layers"] == report.after.layers
    if report.stock_checkpoint:
        tokens = random_tokens(vocab=BYTE_VOCAB)
        with torch.no_grad():
            a = AutoModelForCausalLM.from_pretrained(memory).eval()(tokens).logits
            b = AutoModelForCausalLM.from_pretrained(streamed).eval()(tokens).logits
        torch.testing.assert_close(a, b, rtol=0, atol=0.05 if trained else 0.0)


@pytest.mark.parametrize("stored, run", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_a_streamed_run_in_another_dtype_than_its_checkpoint_writes_the_in_memory_bytes(tmp_path, stored, run):
    """The recipe's dtype differs from the checkpoint's: the units no step changed (here the embeddings, the
    final norm, lm_head and the kept layers) are written in the run's dtype, as in memory (the writer reads
    them from the source file; they were copied in its dtype and the write failed)."""
    model_dir = tmp_path / "model"
    saved_model(model_dir).to(getattr(torch, stored)).save_pretrained(model_dir, max_shard_size="40KB")
    outputs = []
    for stream in ("off", "on"):
        data = {**recipe(tmp_path, model_dir, ["ShortGPT<n:2>"], stream, f"out-{stream}"), "dtype": run}
        recipe_engine.apply(data, progress=False)
        outputs.append(tmp_path / f"out-{stream}")
    assert_same_weights(*outputs)
    assert {t.dtype for t in weights(outputs[1]).values()} == {getattr(torch, run)}


def test_nll_selection_streamed_equals_in_memory(tmp_path):
    """FlattenAdjacent's NLL search runs its candidates from layers loaded one at a time: same merges."""
    model_dir = tmp_path / "model"
    saved_model(model_dir, "qwen2")
    steps = ["FlattenAdjacent<n:2,selection:nll>", "HeadPrune", "NystromMLP"]
    (memory, streamed), report = run_both(tmp_path, model_dir, steps)
    assert_same_weights(memory, streamed)
    assert len(report.steps[0].result["rounds"]) == 2


@pytest.mark.parametrize("step", ["ReplaceMe<n:2,distance_tokens:last>",
                                  {"ReplaceMe": {"n": 3, "objective": "cosine", "adam": {"epochs": 2}}}])
def test_replace_me_streamed_equals_in_memory(tmp_path, step):
    """ReplaceMe's fit pass runs the layers up to the block's end from a streamed skeleton and folds the map
    into a down_proj loaded on its own: the same weights as in memory (Qwen2: q/k/v biases)."""
    model_dir = tmp_path / "model"
    saved_model(model_dir, "qwen2")
    (memory, streamed), report = run_both(tmp_path, model_dir, [step])
    assert_same_weights(memory, streamed)
    result = report.steps[0].result
    assert report.after.layers == 6 - len(result["removed"]) and result["fit"]["tokens"] == 4 * 31


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
def test_flattengpt_streamed_equals_in_memory_across_architectures(tmp_path, model_type, tied):
    model_dir = tmp_path / "model"
    saved_model(model_dir, model_type, shard="2MB" if tied else "40KB", tie_word_embeddings=tied)
    steps = ["FuseNorm", "FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP", "ShortGPT<n:1>"]
    (memory, streamed), report = run_both(tmp_path, model_dir, steps)
    assert_same_weights(memory, streamed)
    assert report.stream.bytes_staged > 0
    # the model's size before, as HF counts it (a tied lm_head once), streamed as in memory
    counted = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    for directory in (memory, streamed):
        assert json.loads((directory / "report.json").read_text())["before"]["parameters"] == counted


def test_streamed_evaluation_matches_in_memory_perplexity(tmp_path):
    model_dir = tmp_path / "model"
    saved_model(model_dir)
    evaluate = {"perplexity": {"dataset": [str(tmp_path / "cal.txt")], "seq_len": 32, "limit": 6}}
    reports = []
    for stream in ("off", "on"):
        data = recipe(tmp_path, model_dir, ["FuseNorm", "ShortGPT<n:2>"], stream, f"eval-{stream}")
        reports.append(recipe_engine.apply({**data, "evaluate": evaluate}, progress=False)[1].evaluation)
    for when in ("before", "after"):
        a, b = getattr(reports[0], when).perplexity, getattr(reports[1], when).perplexity
        assert a.fingerprint == b.fingerprint and a.tokens == b.tokens
        assert b.ppl == pytest.approx(a.ppl, rel=1e-5)
    assert reports[1].after.perplexity.ppl != reports[1].before.perplexity.ppl


def streamed_session(tmp_path):
    """A session on a tiny 6-layer checkpoint streamed from ``tmp_path / "model"`` (staging in
    ``tmp_path / "staging"``), on CPU; returns it and the checkpoint's directory."""
    from recipe_engine.architectures.adapters import adapter_for
    from recipe_engine.execution.context import RunContext
    from recipe_engine.execution.session import Session
    from recipe_engine.execution.streaming import open_stream
    from recipe_engine.sources.models import load_model
    from recipe_engine.recipe.schema import CalibrationConfig

    model_dir = tmp_path / "model"
    saved_model(model_dir)
    model, tokenizer, source = load_model(str(model_dir), skeleton=True)
    adapter = adapter_for(model.config)
    session = Session(RunContext(tokenizer, adapter, CalibrationConfig(batch_size=2), torch.device("cpu")),
                      model, random_tokens(vocab=BYTE_VOCAB),
                      stream=open_stream(model, adapter, source.location, tmp_path / "staging"))
    return session, model_dir


def test_release_stages_only_changed_units(tmp_path, monkeypatch):
    session, model_dir = streamed_session(tmp_path)
    assert not any(is_materialized(layer) for layer in session.layers)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    import recipe_engine.execution.streaming as streaming

    trims = []  # the heap is trimmed once per block, after its units are released
    monkeypatch.setattr(streaming, "trim_heap", lambda: trims.append(is_materialized(session.layers[0])))
    with session.residency.loaded(0, 1):
        layer = session.layers[0]
        torch.testing.assert_close(layer.mlp.up_proj.weight, reference.model.layers[0].mlp.up_proj.weight,
                                   rtol=0, atol=0)
        with torch.no_grad():
            layer.mlp.up_proj.weight.mul_(2)  # layer 0 changes in place; layer 1 is only read
    assert not is_materialized(session.layers[0]) and not is_materialized(session.layers[1])
    session.stream.drain()  # the changed layer's file is written behind the compute
    assert len(list((tmp_path / "staging").iterdir())) == 1 and trims == [False]
    with session.residency.loaded(0):
        torch.testing.assert_close(session.layers[0].mlp.up_proj.weight,
                                   2 * reference.model.layers[0].mlp.up_proj.weight, rtol=0, atol=0)
        with torch.no_grad():
            session.layers[0].mlp.up_proj.weight.mul_(-1)
            session.layers[0].mlp.up_proj.weight.mul_(-1)  # changed (version counter), restaged
    session.stream.drain()
    assert len(list((tmp_path / "staging").iterdir())) == 1  # the obsolete staged state was deleted
    out = tmp_path / "written"
    out.mkdir()
    fingerprint = WeightsFingerprint()
    files = write_checkpoint(session, out, max_shard_bytes=30_000, fingerprint=fingerprint)
    assert not list((tmp_path / "staging").iterdir())  # each staged unit deleted once written
    assert len(files) > 1 and (out / "model.safetensors.index.json").is_file()
    # the fingerprint hashed while writing = the files read back, by the definition and by the engine's reader
    assert [p.name for p in sorted(out.glob("*.safetensors"))] == files
    assert fingerprint.hexdigest() == reference_fingerprint(out) == weights_fingerprint(out)
    written = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(written.model.layers[0].mlp.up_proj.weight, 2 * reference.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(written.model.layers[3].self_attn.q_proj.weight,
                       reference.model.layers[3].self_attn.q_proj.weight)
    assert sorted(CheckpointReader(out).files) == sorted(CheckpointReader(model_dir).files)


def test_stream_on_with_an_in_memory_model_is_refused(tmp_path):
    data = recipe(tmp_path, tmp_path, ["FuseNorm"], "on", "x")
    with pytest.raises(recipe_engine.RecipeError, match="stream: on needs a model from disk"):
        recipe_engine.apply(data, model=tiny_model(), tokenizer=byte_tokenizer(), progress=False)
    assert not (tmp_path / "x").exists()


INTERRUPT = """
import os, signal, sys
from recipe_engine.cli import main
from recipe_engine.execution.streaming import WeightStream
stage, count = WeightStream.stage, [0]
def stage_then_signal(self, unit, behind=False):
    stage(self, unit, behind)
    count[0] += 1
    if count[0] == int(sys.argv[3]) and sys.argv[2] == "exception":
        raise RuntimeError("injected failure")
    if count[0] == int(sys.argv[3]):
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
WeightStream.stage = stage_then_signal
sys.exit(main(["apply", sys.argv[1], "--quiet"]))
"""


@pytest.mark.parametrize("name, staged", [("SIGINT", 1), ("SIGTERM", 9), ("SIGHUP", 10), ("exception", 10)])
def test_signal_mid_pass_leaves_neither_staging_nor_output(tmp_path, name, staged):
    """Killed after the n-th staged unit: 1 FuseNorm's first layer (6 layers, head, norm), 9 the merged layer
    (FlattenAdjacent), 10 the pruned layer (the HeadPrune + NystromMLP pass)."""
    model_dir = tmp_path / "model"
    saved_model(model_dir)
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path, model_dir, ["FuseNorm", "FlattenAdjacent<n:1>", "HeadPrune",
                                                                  "NystromMLP"], "on", "out")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", INTERRUPT, str(path), name, str(staged)], env=env,
                         capture_output=True, text=True, timeout=300)
    if name == "exception":
        assert run.returncode == 1 and "injected failure" in run.stderr
    else:
        assert run.returncode == 128 + getattr(signal, name), run.stderr[-2000:]
        assert run.stderr.strip().splitlines()[-1] == f"interrupted by {name}; nothing written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.txt", "model", "r.yaml"]


def test_recipe_eval_streamed_perplexity_equals_in_memory(tmp_path):
    model_dir = tmp_path / "model"
    saved_model(model_dir)
    text = tmp_path / "eval.txt"
    text.write_text(TEXT)
    records = []
    for stream in ("off", "on"):
        record = tmp_path / f"{stream}.json"
        run = subprocess.run([sys.executable, "-m", "recipe_engine.cli", "eval", str(model_dir), "--dataset", str(text),
                              "--seq-len", "32", "--limit", "5", "--device", "cpu", "--stream", stream,
                              "--json", str(record)], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert run.returncode == 0, run.stderr[-2000:]
        records.append(json.loads(record.read_text())["perplexity"])
    assert records[0]["fingerprint"] == records[1]["fingerprint"] and records[0]["windows"] == 5
    assert records[1]["ppl"] == pytest.approx(records[0]["ppl"], rel=1e-6)


PACKED = "export:compressed-tensors"


@pytest.mark.parametrize("steps, message", [
    ([f"GPTQ<group_size:32,{PACKED}>", "FuseNorm"], "changes weights that step 0 \\(GPTQ\\) quantized"),
    ([f"Quantize<group_size:32,{PACKED}>", "LoRARecovery"], "changes weights that step 0 \\(Quantize\\) quantized"),
    ([f"GPTQ<group_size:32,{PACKED}>", "Quantize<group_size:32>"], "changes weights that step 0 \\(GPTQ\\) quantized"),
])
def test_weight_change_after_quantizing_is_a_validation_error(tmp_path, steps, message):
    from recipe_engine.recipe.schema import recipe_from_dict
    from recipe_engine.plan.preflight import check_against_config
    from tests.helpers import tiny_config

    data = recipe(tmp_path, tmp_path, steps, "off", "q")
    with pytest.raises(recipe_engine.RecipeError, match=message) as error:
        check_against_config(recipe_from_dict(data), tiny_config(), "r.yaml")
    assert "step 1" in str(error.value) and "r.yaml" in str(error.value)
    for allowed in (["ShortGPT<n:1>", f"GPTQ<group_size:32,{PACKED}>", "LinearPatch"],  # a patch, not weights
                    ["GPTQ<group_size:32,export:dequantized>", "LoRARecovery"]):  # recovery may move them
        check_against_config(recipe_from_dict({**data, "modifiers": allowed}), tiny_config(num_hidden_layers=6),
                             "r.yaml")


@pytest.mark.parametrize("behind, batch", [(0, 0), (1 << 30, 1 << 30), (0, 40)])
def test_incremental_safetensors_writer_matches_the_library(tmp_path, monkeypatch, behind, batch):
    """The library reads what it wrote, whether each tensor waits for the last to be written (``behind``: 0) or
    many wait on the writing threads, handed over one at a time (``batch``: 0), all at once or a few; the
    digests are the sha256 of the file's header (with its length) and of each tensor's bytes, in file order."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from recipe_engine.checkpoint import safetensors_file
    from recipe_engine.checkpoint.safetensors_file import write_safetensors_incrementally

    monkeypatch.setattr(safetensors_file, "WRITE_BEHIND_BYTES", behind)
    monkeypatch.setattr(safetensors_file, "HASH_BATCH_BYTES", batch)

    generator = torch.Generator().manual_seed(0)
    tensors = {"b.weight": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
               "a.bias": torch.randn(7, generator=generator), "c.ids": torch.arange(6, dtype=torch.int64).view(2, 3),
               "d.half": torch.randn(1, generator=generator).to(torch.float16)}
    layout = {name: t.to("meta") for name, t in tensors.items()}
    digests = []
    write_safetensors_incrementally(tmp_path / "ours.safetensors", layout,
                                    ({name: t} for name, t in tensors.items()), digests)
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    data = (tmp_path / "ours.safetensors").read_bytes()
    base = 8 + int.from_bytes(data[:8], "little")
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    bounds = [base + sum(sizes[:i]) for i in range(len(sizes) + 1)]
    assert bounds[-1] == len(data)
    assert digests == [hashlib.sha256(data[:base]).digest()] + [hashlib.sha256(data[a:b]).digest()
                                                               for a, b in zip(bounds, bounds[1:])]
    for file in ("ours", "lib"):
        with safe_open(str(tmp_path / f"{file}.safetensors"), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            assert all(torch.equal(handle.get_tensor(n), t) for n, t in tensors.items())
    with pytest.raises(RuntimeError, match="got a.bias .*, expected b.weight"):
        write_safetensors_incrementally(tmp_path / "bad.safetensors", layout, iter([{"a.bias": tensors["a.bias"]}]))


def test_a_failed_write_behind_the_packing_is_raised(tmp_path, monkeypatch):
    """A write that fails on the writing thread (here: the disk full at the second tensor) ends the file's
    writing with that error, not with a file that looks complete."""
    from recipe_engine.checkpoint.safetensors_file import write_safetensors_incrementally

    tensors = {f"t{i}.weight": torch.full((64,), float(i)) for i in range(4)}
    real_open, writes = open, []

    class DiskFull:
        def __init__(self, handle):
            self.handle = handle

        def write(self, data):
            writes.append(len(data))
            if len(writes) == 3:  # header, t0, then t1
                raise OSError(28, "No space left on device")
            return self.handle.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

    monkeypatch.setattr("builtins.open", lambda *a, **k: DiskFull(real_open(*a, **k)))
    with pytest.raises(OSError, match="No space left"):
        write_safetensors_incrementally(tmp_path / "x.safetensors", {n: t.to("meta") for n, t in tensors.items()},
                                        ({n: t} for n, t in tensors.items()))
    assert len(writes) == 3  # nothing written after the failure


@pytest.mark.parametrize("model_type, tied", [("llama", False), ("qwen2", True)])
def test_memory_estimate_terms_match_the_model(tmp_path, model_type, tied):
    """The estimate's model size equals the parameters HF builds (× dtype bytes); NystromMLP's working memory
    is its fp64 Gram of the merged width (factored in place) and the refit's kept-width system; the streamed peak
    is far below the in-memory one."""
    from recipe_engine.plan.estimates import estimate
    from recipe_engine.recipe.schema import recipe_from_dict
    from tests.helpers import tiny_config

    config = tiny_config(model_type, num_hidden_layers=6, tie_word_embeddings=tied)
    steps = ["FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"]
    data = recipe(tmp_path, tmp_path, steps, "on", "m")
    plans = {streamed: estimate(recipe_from_dict({**data, "dtype": "bfloat16"}), config, streamed, runtime=0)
             for streamed in (False, True)}
    model = AutoModelForCausalLM.from_config(config)
    assert plans[True].model_bytes == 2 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    nystrom = plans[True].steps[2]
    merged = 2 * config.intermediate_size  # the widest merged layer joins two layers
    kept = config.intermediate_size  # Theorem 3.1: G, G_KK, two panels, rhs solved in place; then 2 G_KK
    hidden = config.hidden_size
    assert nystrom.working_bytes == 8 * max(merged**2 + kept**2 + 2 * merged * 512 + kept * hidden,
                                            2 * kept**2 + 2 * kept * hidden)
    assert [s.whole_model for s in plans[True].steps] == [False, False, False]
    assert all(s.whole_model for s in plans[False].steps)
    assert plans[True].host_peak_bytes < plans[False].host_peak_bytes
    lora = estimate(recipe_from_dict({**data, "modifiers": ["LoRARecovery"]}), config, True, runtime=0)
    assert lora.steps[0].whole_model and lora.steps[0].weights_bytes >= lora.model_bytes


@pytest.mark.parametrize("streamed", [False, True])
def test_device_estimate_counts_an_in_memory_evaluation(tmp_path, streamed):
    """``evaluate: perplexity`` on an in-memory model moves the whole model to the device (``evaluate_model``):
    the device peak is at least those weights (HF's parameter count) and one window's logits (fp32, and their
    fp32 log-softmax: tests/test_perplexity.py measures it); a streamed evaluation keeps one layer there, so it
    adds no model there, and computes its NLL a batch at a time (2 windows' bf16 logits, one window's fp32
    copy, contiguous copy and log-softmax)."""
    from recipe_engine.plan.estimates import estimate
    from recipe_engine.recipe.schema import recipe_from_dict
    from tests.helpers import tiny_config

    config = tiny_config("llama", num_hidden_layers=6)
    data = {**recipe(tmp_path, tmp_path, ["ShortGPT<n:2>"], "on", "m"), "dtype": "bfloat16",
            "evaluate": {"perplexity": {"dataset": str(tmp_path / "cal.txt"), "seq_len": 64}}}
    plan = estimate(recipe_from_dict(data), config, streamed, runtime=100, on_device=True)
    whole = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()) * 2
    logits = 64 * config.vocab_size * ((2 * 2 + 12) if streamed else 8)
    assert plan.evaluation_device_bytes == (0 if streamed else whole + logits)
    assert plan.device_peak_bytes == max(plan.activations_bytes + max(
        s.device_weights_bytes + s.working_bytes for s in plan.steps), plan.evaluation_device_bytes)
    assert (plan.device_peak_bytes >= whole + logits) != streamed
    # the activations on the host: the evaluation there, the model as the steps hold it (streamed: the embedding
    # at least) and the window; here it is the host peak, which recipe plan says
    host = estimate(recipe_from_dict(data), config, streamed, runtime=100)
    held = max(config.vocab_size * config.hidden_size * 2, max(s.device_weights_bytes for s in host.steps)) \
        if streamed else whole
    assert host.evaluation_window_bytes == logits and host.evaluation_host_bytes == 100 + held + logits
    assert host.host_peak_bytes == max(max(s.host_bytes for s in host.steps), host.evaluation_host_bytes,
                                       100 + host.activations_bytes + config.vocab_size * config.hidden_size * 2
                                       if streamed else 0)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_memory_estimate_on_a_cuda_gpu_counts_its_runtime_and_pinned_copies(tmp_path, streamed, model_type):
    """On a CUDA GPU the host also holds the runtime's own share and, in a streamed pass, two page-locked copies
    of the largest layer (read ahead, on its way to staging), each tensor rounded up to a power of two: the
    difference to the same plan without the GPU, checked against the tensors HF builds for a layer."""
    import math

    from recipe_engine.plan.estimates import ACCELERATOR_RUNTIME_BYTES, estimate, unmeasured_accelerator_runtime
    from recipe_engine.recipe.schema import recipe_from_dict
    from tests.helpers import tiny_config

    config = tiny_config(model_type, num_hidden_layers=4)
    data = {**recipe(tmp_path, tmp_path, ["GPTQ<group_size:16>"], "on", "m"), "dtype": "bfloat16"}
    for on_device in (False, True):
        plain = estimate(recipe_from_dict(data), config, streamed, runtime=100, on_device=on_device)
        on_gpu = estimate(recipe_from_dict(data), config, streamed, runtime=100, on_device=on_device,
                          accelerator=True)
        with torch.device("meta"):
            layer = AutoModelForCausalLM.from_config(config).model.layers[0]
        pinned = sum(2 ** math.ceil(math.log2(t.numel() * 2)) for t in layer.state_dict().values())
        assert on_gpu.accelerator_runtime_bytes == ACCELERATOR_RUNTIME_BYTES and plain.accelerator_runtime_bytes == 0
        assert [s.pinned_bytes for s in on_gpu.steps] == [2 * pinned if streamed else 0]
        assert on_gpu.steps[0].host_bytes - plain.steps[0].host_bytes == \
            ACCELERATOR_RUNTIME_BYTES + (2 * pinned if streamed else 0)
        assert on_gpu.host_peak_bytes > plain.host_peak_bytes and on_gpu.device_peak_bytes == plain.device_peak_bytes
    assert unmeasured_accelerator_runtime(torch.device("cpu")) == 0
    if not torch.cuda.is_available():  # a process that has not started CUDA: its measured runtime lacks it
        assert unmeasured_accelerator_runtime(torch.device("cuda")) == ACCELERATOR_RUNTIME_BYTES


@pytest.mark.parametrize("streamed", [False, True])
def test_memory_estimate_with_the_activations_on_a_device(tmp_path, capsys, streamed):
    """With the activations on an accelerator the host holds the runtime and the weights a step holds (a
    streamed run: at least the embedding), and the device the activations (4 sets of the calibration
    tokens' hidden states, one batch's MLP intermediate ×3 in fp32) plus the largest step's weights and
    working memory; ``recipe plan`` prints both for a recipe on a GPU, and nothing of it for one on CPU."""
    from recipe_engine.cli import main
    from recipe_engine.plan.estimates import estimate
    from recipe_engine.recipe.schema import recipe_from_dict
    from tests.helpers import tiny_config

    config = tiny_config("llama", num_hidden_layers=6)
    data = {**recipe(tmp_path, tmp_path, ["FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"], "on", "m"),
            "dtype": "bfloat16"}
    host = estimate(recipe_from_dict(data), config, streamed, runtime=100)
    device = estimate(recipe_from_dict(data), config, streamed, runtime=100, on_device=True)
    activations = 4 * 4 * 32 * config.hidden_size * 2 + 3 * 2 * 32 * config.intermediate_size * 4
    assert host.activations_bytes == device.activations_bytes == activations
    held = max(s.weights_bytes + s.read_ahead_bytes for s in device.steps)
    largest = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).model.layers[0].parameters()) * 2
    # the next layer, read ahead: of the original model, then of the shape each step receives (merged: wider)
    assert device.steps[0].read_ahead_bytes == (largest if streamed else 0)
    assert all((largest < s.read_ahead_bytes <= s.weights_bytes) if streamed else s.read_ahead_bytes == 0
               for s in device.steps[1:])
    embedding = config.vocab_size * config.hidden_size * 2
    assert device.host_peak_bytes == 100 + (max(held, embedding) if streamed else held)
    # on the device, in memory as streamed: the layers in use, not the whole model (the run moves them there)
    as_streamed = estimate(recipe_from_dict(data), config, True, runtime=100, on_device=True)
    assert [s.device_weights_bytes for s in device.steps] == [s.weights_bytes for s in as_streamed.steps]
    if not streamed:  # the layer-scope steps hold a layer or two there, the host the whole model
        assert all(s.device_weights_bytes <= 2 * largest * 1.5 < s.weights_bytes for s in device.steps[1:])
    assert device.device_peak_bytes == activations + max(s.device_weights_bytes + s.working_bytes
                                                         for s in device.steps)
    for on_host, on_accelerator in zip(host.steps, device.steps):
        assert on_host.host_bytes - on_accelerator.host_bytes == \
            activations + on_host.working_bytes + on_host.kept_states_bytes
        assert on_accelerator.kept_states_bytes == 0  # kept only when the activations live on the host
    # the original model's states after each of the 6 layers, kept from FlattenAdjacent through NystromMLP
    # (target: original reads them): 6 sets of 4 × 32 bf16 hidden states
    assert [s.kept_states_bytes for s in host.steps] == [6 * 4 * 32 * config.hidden_size * 2] * 3
    assert host.device_peak_bytes is None

    model_dir = tmp_path / "model"
    saved_model(model_dir)
    for where, shown in (("cuda", True), ("cpu", False)):
        path = tmp_path / f"{where}.yaml"
        path.write_text(yaml.safe_dump({**recipe(tmp_path, model_dir, ["FlattenAdjacent<n:2>"], "off", where),
                                        "device": where}))
        assert main(["plan", str(path), "--json"]) == 0
        memory = json.loads(capsys.readouterr().out)["memory"]
        assert ("accelerator" in memory) == shown
        assert main(["plan", str(path)]) == 0
        assert ("with the activations on an accelerator" in capsys.readouterr().out) == shown
    assert memory["host_peak_bytes"] > 0


@pytest.mark.parametrize("steps", [["GPTQ<group_size:32,export:compressed-tensors>"],
                                   ["FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP",
                                    "Quantize<group_size:32,sym:false,export:compressed-tensors>"]])
def test_packed_export_streamed_equals_in_memory_without_the_whole_model(tmp_path, monkeypatch, steps):
    """The engine's writer packs quantized linears unit by unit: a streamed run never makes the whole
    model resident (``Residency.resident`` is refused), and its packed files equal the in-memory run's."""
    from recipe_engine.execution.residency import Residency

    model_dir = tmp_path / "model"
    saved_model(model_dir)
    recipe_engine.apply(recipe(tmp_path, model_dir, steps, "off", "out-off"), progress=False)

    def refuse(_session):
        raise AssertionError("the whole model was made resident")
    monkeypatch.setattr(Residency, "resident", refuse)
    recipe_engine.apply(recipe(tmp_path, model_dir, steps, "on", "out-on"), progress=False)
    assert_same_weights(tmp_path / "out-off", tmp_path / "out-on")
    configs = [json.loads((tmp_path / f"out-{s}" / "config.json").read_text()) for s in ("off", "on")]
    assert configs[0]["quantization_config"] == configs[1]["quantization_config"]
    assert any(name.endswith("weight_packed") for name in weights(tmp_path / "out-on"))


@pytest.mark.parametrize("in_blocks", [False, True])
@pytest.mark.parametrize("bits, group, sym, rows", [(4, 32, True, 96), (4, None, False, 100), (8, 16, False, 64),
                                                    (8, None, True, 72), (4, 64, False, 13)])
def test_packed_layout_is_what_the_compressor_returns(monkeypatch, bits, group, sym, rows, in_blocks):
    """The writer fixes each file's header before packing: its layout, and the packed tensors themselves, must
    be the library's ``PackedQuantizationCompressor.compress`` output; also when the host takes the rows in blocks
    (here 7 rows for the codes and 14 for the packing, a last block shorter)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    from recipe_engine.formats import checkpoint_exporter
    from recipe_engine.formats.compressed_tensors import scheme
    from recipe_engine.numerics import quantization
    from recipe_engine.numerics.quantization import Grid, QuantizedLinear

    if in_blocks:
        monkeypatch.setattr(quantization, "HOST_BLOCK_BYTES", 7 * 8 * 128)

    grid = Grid(bits, group, sym, torch.float32)
    weight = torch.randn(rows, 128, dtype=torch.float32)
    groups = 128 // (group or 128)
    scale = torch.stack([grid.params(weight[:, g * 128 // groups:(g + 1) * 128 // groups].double())[0]
                         for g in range(groups)], 1)
    zero = torch.stack([grid.params(weight[:, g * 128 // groups:(g + 1) * 128 // groups].double())[1]
                        for g in range(groups)], 1)
    record = QuantizedLinear(grid, scale.float(), zero.to(torch.int16))
    on_grid = grid.fake(weight.double(), grid.expand(scale, 128), grid.expand(zero, 128)).to(weight.dtype)
    exporter = checkpoint_exporter("compressed-tensors")
    packed = exporter.pack("layer", on_grid, record)
    layout = exporter.layout(on_grid, record)
    library = PackedQuantizationCompressor.compress(
        {"weight": on_grid, "weight_scale": record.scale, "weight_zero_point": (zero - 2 ** (bits - 1)).to(torch.int8)},
        scheme(grid))
    assert list(packed) == list(layout)
    assert all(packed[k].shape == layout[k].shape and packed[k].dtype == layout[k].dtype for k in layout)
    assert all(torch.equal(packed[k], library[k]) for k in layout)


def test_report_records_each_steps_peak_beside_its_estimate(tmp_path):
    """Per-step peaks come from the kernel's high-water mark reset per step: they differ between steps,
    none exceeds the run's peak, and the largest equals it when the peak is inside a step."""
    model_dir = tmp_path / "model"
    saved_model(model_dir)
    steps = ["FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"]
    _, report = recipe_engine.apply(recipe(tmp_path, model_dir, steps, "on", "out"), progress=False)
    peaks = [s.peak_rss_mib for s in report.steps]
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/self/clear_refs: per-step peaks are not measured here")
    assert all(p is not None and 0 < p <= report.peak_memory.rss_mib for p in peaks)
    assert all(s.estimate_rss_mib > 0 for s in report.steps)
    assert report.steps[1].estimate_rss_mib == report.steps[2].estimate_rss_mib  # one shared pass


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux only: VmHWM")
def test_a_run_started_by_a_large_process_reports_its_own_peak_not_its_parents():
    """Linux carries ``ru_maxrss`` across fork and exec: a process started by one holding 1 GiB reads 1 GiB there
    before it has allocated anything. The run's peak (``PeakWatch``, the report's ``peak_memory``) is the process's
    own high-water mark, as ``/proc/self/status`` shows it."""
    import subprocess
    import sys

    held = bytearray(1 << 30)
    held[::4096] = b"\1" * len(held[::4096])  # resident in this process
    child = ("import resource; from recipe_engine.system.host_memory import PeakWatch, high_water_bytes; "
             "w = PeakWatch(); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, w.overall_bytes, "
             "high_water_bytes())")
    inherited, overall, own = map(int, subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                                                      check=True, cwd=Path(__file__).parents[1]).stdout.split())
    del held
    assert inherited >= 1 << 30  # what the kernel's getrusage says
    assert overall == own or abs(overall - own) < 8 << 20
    assert own < 256 << 20  # the child's own: the interpreter and the engine's package, no weights


@pytest.mark.skipif(not (shared_data() / "piqa").is_dir() and not (shared_data() / "arc").is_dir(),
                    reason="needs shared/data task files")
def test_streamed_zero_shot_equals_in_memory_with_one_unit_resident(tmp_path, monkeypatch):
    """lm-eval on a streamed skeleton (accelerate hooks load each unit for its forward) gives the in-memory
    scores, and never holds more than one unit plus the tied head's embedding at a time."""
    from recipe_engine.evaluation.run import evaluate_session, evaluation_session
    from recipe_engine.recipe.schema import EvaluateConfig
    from recipe_engine.execution.streaming import WeightStream

    model_dir = tmp_path / "model"
    saved_model(model_dir)
    config = EvaluateConfig(perplexity=None, tasks=["arc_easy"], limit=6)
    results = {}
    most = {"now": 0, "max": 0}
    materialize, release = WeightStream.materialize, WeightStream.release

    def counting_materialize(self, unit, device=torch.device("cpu")):
        was = is_materialized(unit)
        materialize(self, unit, device)
        most["now"] += not was
        most["max"] = max(most["max"], most["now"])

    def counting_release(self, unit):
        was = is_materialized(unit)
        release(self, unit)
        most["now"] -= was and not is_materialized(unit)

    monkeypatch.setattr(WeightStream, "materialize", counting_materialize)
    monkeypatch.setattr(WeightStream, "release", counting_release)
    for stream in ("off", "on"):
        session, _ = evaluation_session(str(model_dir), "float32", torch.device("cpu"), stream)
        results[stream] = evaluate_session(session, config).zero_shot
    assert results["on"].tasks == results["off"].tasks
    assert most["max"] == 1 and most["now"] == 0


def test_output_size_estimate_is_the_compressed_models_size(tmp_path):
    """The free-space check counts the checkpoint the recipe writes (fewer, narrower layers), not the
    input model: the estimate equals the written safetensors' tensor bytes."""
    from recipe_engine.plan.estimates import output_bytes
    from recipe_engine.recipe.schema import recipe_from_dict

    model_dir = tmp_path / "model"
    saved_model(model_dir)
    steps = ["FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"]
    data = recipe(tmp_path, model_dir, steps, "on", "out")
    recipe_engine.apply(data, progress=False)
    written = sum(t.numel() * t.element_size() for t in weights(tmp_path / "out").values())
    config = AutoConfig.from_pretrained(model_dir)
    assert output_bytes(recipe_from_dict(data), config) == written
    assert output_bytes(recipe_from_dict({**data, "modifiers": ["FuseNorm"]}), config) > written


def test_a_staging_write_behind_the_compute_is_read_whole_or_its_error_raised(tmp_path, monkeypatch):
    """A released unit's file is written by a thread while the compute goes on: loading the unit again waits
    for it (the tensors read back are the changed ones); a write that fails raises its error where the unit
    is next read, or where ``drain`` waits for it."""
    import threading

    import recipe_engine.execution.streaming as streaming

    session, _ = streamed_session(tmp_path)
    release, writers = threading.Event(), []
    real_save = streaming.save_file

    def slow_save(tensors, path):  # holds the write until the main thread has moved on
        writers.append(threading.current_thread().name)
        release.wait(10)
        real_save(tensors, path)

    monkeypatch.setattr(streaming, "save_file", slow_save)
    with session.residency.loaded(0):
        expected = session.layers[0].mlp.up_proj.weight.detach().clone() * 3
        with torch.no_grad():
            session.layers[0].mlp.up_proj.weight.mul_(3)
    assert not is_materialized(session.layers[0]) and not list((tmp_path / "staging").glob("*.safetensors"))
    release.set()
    with session.residency.loaded(0):  # waits for the write, then reads the changed weights
        assert torch.equal(session.layers[0].mlp.up_proj.weight, expected)
    assert writers and writers[0].startswith("recipe-staging")

    def full_disk(tensors, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(streaming, "save_file", full_disk)
    with session.residency.loaded(1):
        with torch.no_grad():
            session.layers[1].mlp.up_proj.weight.mul_(2)
    with pytest.raises(OSError, match="No space left"):
        session.stream.drain()
    with session.residency.loaded(2):
        with torch.no_grad():
            session.layers[2].mlp.up_proj.weight.mul_(2)
    with pytest.raises(OSError, match="No space left"):
        with session.residency.loaded(2):
            pass


@pytest.mark.parametrize("stream", ["off", "on"])
def test_only_a_streamed_model_bounds_the_heap(tmp_path, monkeypatch, stream):
    """The heap bound (glibc's mmap threshold, which page-faults every activation buffer afresh) is set for a
    model streamed for compression, not for the original model streamed beside an in-memory run for its
    reference targets."""
    import recipe_engine.execution.streaming as streaming

    calls = []
    monkeypatch.setattr(streaming, "release_freed_memory_eagerly", lambda: calls.append(True))
    model_dir = tmp_path / "model"
    saved_model(model_dir)
    steps = ["FuseNorm", "FlattenAdjacent<n:1>", "HeadPrune", "NystromMLP"]  # target: original reads the reference
    _, report = recipe_engine.apply(recipe(tmp_path, model_dir, steps, stream, "out"), progress=False,
                                    checkpoints=False)
    assert report.streamed is (stream == "on")
    assert bool(calls) is (stream == "on")


def test_a_pass_reads_each_next_layer_ahead_once_and_never_from_a_stale_home(tmp_path, monkeypatch):
    """Using layer i on the device starts reading layer i + 1 on a thread; materializing it takes those tensors
    (each layer read once, the same weights as HF's own load). A read-ahead of a layer that is not used next
    is dropped, and a layer whose home changed after it was read ahead is read from its new home."""
    import threading

    from safetensors.torch import save_file

    session, model_dir = streamed_session(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    reads, real_read = [], CheckpointReader.read

    def counted(self, names):
        names = list(names)
        reads.append((threading.current_thread().name, int(names[0].split(".")[2])))
        return real_read(self, names)

    monkeypatch.setattr(CheckpointReader, "read", counted)
    for i in range(6):
        with session.view.placed(i):
            torch.testing.assert_close(session.layers[i].state_dict(), reference.model.layers[i].state_dict(),
                                       rtol=0, atol=0)
    assert [layer for _, layer in reads] == [0, 1, 2, 3, 4, 5]
    assert reads[0][0] == "MainThread" and all(name.startswith("recipe-read-ahead") for name, _ in reads[1:])

    reads.clear()
    with session.view.placed(0):   # reads layer 1 ahead ...
        pass
    with session.residency.loaded(3):   # ... which is not used next: dropped, layer 3 read here
        pass
    with session.view.placed(1):   # reads layer 2 ahead: wait for that read before counting
        pass
    session.stream._ahead[2].result()
    assert [layer for _, layer in reads] == [0, 1, 3, 1, 2]

    layer = session.layers[4]
    changed = {name: 2 * t for name, t in reference.model.layers[4].state_dict().items()}
    save_file(changed, str(tmp_path / "layer4.safetensors"))
    session.stream.read_ahead(layer)
    session.stream.adopt(layer, tmp_path / "layer4.safetensors", {name: name for name in changed})
    with session.residency.loaded(4):
        torch.testing.assert_close(session.layers[4].state_dict(), changed, rtol=0, atol=0)


def test_the_output_writer_reads_each_next_unit_ahead_once(tmp_path, monkeypatch):
    """Writing a streamed run's output reads each staged unit once, every unit after the first on the read-ahead
    thread while the one before is packed and written; the output equals the in-memory run's, byte for byte."""
    import threading

    from recipe_engine.execution import streaming

    model_dir = tmp_path / "model"
    saved_model(model_dir)
    steps = ["GPTQ<group_size:32>"]
    recipe_engine.apply(recipe(tmp_path, model_dir, steps, "off", "in-memory"), progress=False)
    reads, writing = [], threading.Event()
    real_read, real_write = streaming.StagedFile.read, streaming.WeightStream.read_unit

    def counted(self, names):
        names = list(names)
        if writing.is_set():
            reads.append((threading.current_thread().name, self.path.name))
        return real_read(self, names)

    def read_unit(self, unit):
        writing.set()  # the pass is over: only the writer reads units now
        return real_write(self, unit)

    monkeypatch.setattr(streaming.StagedFile, "read", counted)
    monkeypatch.setattr(streaming.WeightStream, "read_unit", read_unit)
    recipe_engine.apply(recipe(tmp_path, model_dir, steps, "on", "streamed"), progress=False)
    files = [file for _, file in reads]  # the layers GPTQ changed: staged during the pass
    assert len(files) == len(set(files)) == AutoConfig.from_pretrained(model_dir).num_hidden_layers
    assert all(name.startswith("recipe-read-ahead") for name, _ in reads[1:])  # the first: maybe the pass's
    assert (tmp_path / "streamed/model.safetensors").read_bytes() == \
        (tmp_path / "in-memory/model.safetensors").read_bytes()


def test_a_streamed_whole_model_forward_reads_each_next_unit_ahead(tmp_path, monkeypatch):
    """Under ``forward_streamed`` each unit's forward reads the next unit ahead (embeddings, layers, norm,
    head, then the next forward's embeddings): two forwards read every unit once per forward, all but the very
    first on the read-ahead thread, and the logits equal HF's own forward of the checkpoint."""
    import threading

    from recipe_engine.execution.streaming import forward_streamed

    session, model_dir = streamed_session(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    threads, real_read = [], CheckpointReader.read

    def counted(self, names):
        threads.append(threading.current_thread().name)
        return real_read(self, names)

    monkeypatch.setattr(CheckpointReader, "read", counted)
    ids = torch.randint(0, BYTE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), forward_streamed(session, torch.device("cpu")):
        logits = [session.model(input_ids=ids).logits for _ in range(2)]
    units = len(session.residency.stream_units())
    session.stream._reader.submit(lambda: None).result()  # one reader thread: the reads queued before are done
    assert len(threads) == 2 * units + 1  # the wrap-around read of a third forward's embeddings ...
    assert session.stream._ahead is None  # ... dropped when the block ends
    assert threads[0] == "MainThread" and all(name.startswith("recipe-read-ahead") for name in threads[1:])
    expected = reference(input_ids=ids).logits
    for got in logits:
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
