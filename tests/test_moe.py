"""Mixture-of-experts architectures (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, gpt-oss; tiny random
checkpoints with 4 experts, top-2): the config/weights check and the weight stream on the Hub's per-expert names
and on transformers' fused names; depth methods streamed and in memory (outputs that stock ``from_pretrained``
loads with the engine's logits); ReplaceMe's fold into every expert against the same map applied as a hook; the
shipped auto recipe; resumed and data-parallel runs; memory estimates against the parameters HF builds; one-line
refusals of what the engine does not handle."""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

import recipe_engine
from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.architectures.shape import ModelShape
from recipe_engine.cli import main
from recipe_engine.errors import SourceError
from recipe_engine.checkpoint.reader import CheckpointReader
from recipe_engine.sources.models import load_config, skeleton_model
from recipe_engine.plan.estimates import shape_bytes
from tests.helpers import (MOE_ARCHITECTURES, BYTE_VOCAB, CharTokenizer, random_tokens, save_tiny_model,
                           spawn_two_ranks, tiny_config, tiny_model)
from tests.test_distributed import assert_same_choices

TEXT = "Mixture-of-experts calibration text, repeated so that every window is full of tokens. " * 200


def recipe(tmp_path, model, steps, stream="off", name="out"):
    data = tmp_path / "cal.txt"
    data.write_text(TEXT)
    return {"version": 1, "name": name, "model": str(model), "output": str(tmp_path / name), "stream": stream,
            "calibration": {"dataset": str(data), "samples": 4, "seq_len": 32, "batch_size": 2}, "modifiers": steps}


def disk_names(directory) -> list[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        return list(handle.keys())


def fused_copy(source, target):
    """The checkpoint in ``source`` rewritten with the in-memory (fused expert) names."""
    target.mkdir()
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (target / file.name).write_bytes(file.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(source)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, target / "model.safetensors",
              metadata={"format": "pt"})


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_per_expert_and_fused_names_both_pass_the_weights_check_and_stream(tmp_path, model_type):
    """transformers 5.24 writes the Hub's per-expert names (``block_sparse_moe.experts.0.w1.weight``) and loads
    them fused: the check and the stream read both forms, tensor for tensor what ``from_pretrained`` builds."""
    model = save_tiny_model(tmp_path / "hub", model_type, num_hidden_layers=2)
    names = disk_names(tmp_path / "hub")
    assert any(".experts.0." in n for n in names) and not any(n.endswith("experts.gate_up_proj") for n in names)
    fused_copy(tmp_path / "hub", tmp_path / "fused")
    assert any(n.endswith("experts.gate_up_proj") for n in disk_names(tmp_path / "fused"))
    for form in ("hub", "fused"):
        load_config(str(tmp_path / form))  # the check: no "missing/unexpected tensors"
        reader = CheckpointReader(tmp_path / form, skeleton_model(str(tmp_path / form), torch.float32))
        read = reader.read(list(model.state_dict()))
        for name, value in model.state_dict().items():
            torch.testing.assert_close(read[name], value, rtol=0, atol=0, msg=f"{form}: {name}")


def test_a_missing_expert_is_named_in_one_line(tmp_path):
    save_tiny_model(tmp_path / "hub", "mixtral", num_hidden_layers=2)
    path = tmp_path / "hub" / "model.safetensors"
    with safe_open(str(path), "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys() if ".experts.3." not in k or "layers.1." not in k}
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(SourceError) as caught:
        load_config(str(tmp_path / "hub"))
    assert "do not match its config.json" in str(caught.value) and "experts.gate_up_proj" in str(caught.value)
    assert "\n" not in str(caught.value)


DEPTH = {"ShortGPT": ["ShortGPT<n:1>"], "SLEB": ["SLEB<n:1>"], "ReplaceMe": ["ReplaceMe<n:1>"],
         "LinearPatch": ["ShortGPT<n:1>", "LinearPatch"], "FuseNorm": ["FuseNorm<untie:true>"],
         "BestOf": ["BestOf<alternatives:[[ShortGPT<n:1>],[ReplaceMe<n:1>],[LaCo<samples:2>]]>"]}


@pytest.mark.parametrize("model_type", MOE_ARCHITECTURES)
@pytest.mark.parametrize("method", list(DEPTH))
def test_depth_methods_streamed_equal_in_memory_and_reload_stock(tmp_path, model_type, method):
    """From the per-expert checkpoint: the streamed run writes the in-memory run's bytes, and the output loads
    with stock ``from_pretrained`` (LinearPatch: ``recipe_engine.load_model``) with the engine's logits."""
    save_tiny_model(tmp_path / "model", model_type, num_hidden_layers=4)
    steps = DEPTH[method]
    result, report = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", steps), progress=False)
    tokens = random_tokens(vocab=BYTE_VOCAB)
    with torch.no_grad():
        expected = result(tokens).logits
    out = tmp_path / "out"
    reloaded = (AutoModelForCausalLM.from_pretrained(out) if report.stock_checkpoint
                else recipe_engine.load_model(str(out))[0]).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    if method == "BestOf":
        assert "mixture of" in json.dumps(report.steps[0].result)  # LaCo refused, skipped
        return  # BestOf runs its alternatives on in-memory copies only
    streamed, _ = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", steps, "on", "streamed"), progress=False)
    for file in ("model.safetensors",):
        with safe_open(str(out / file), "pt") as a, safe_open(str(tmp_path / "streamed" / file), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            for key in a.keys():
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


@pytest.mark.parametrize("model_type", MOE_ARCHITECTURES)
def test_replace_me_fold_into_every_expert_equals_the_map_as_a_hook(tmp_path, model_type):
    """``T`` folded into every expert's down projection (and biases) computes what ``y ← y T`` on the MoE
    block's output computes (``fold: hook``, the map applied to the output by a forward hook)."""
    model = tiny_model(model_type, num_hidden_layers=4)
    runs = {}
    for fold in ("down_proj", "hook"):
        (tmp_path / fold).mkdir()
        data = recipe(tmp_path / fold, "tiny", [f"ReplaceMe<n:1,fold:{fold}>"])
        runs[fold] = recipe_engine.apply(data, model=copy.deepcopy(model), tokenizer=CharTokenizer(), progress=False)
    folded, hooked = runs["down_proj"][0], runs["hook"][0]
    assert runs["down_proj"][1].steps[0].result["start"] == runs["hook"][1].steps[0].result["start"]
    start = runs["down_proj"][1].steps[0].result["start"]
    experts = adapter_for(model.config).experts
    before = experts.experts(model.model.layers[start - 1]).down_proj
    assert not torch.allclose(experts.experts(folded.model.layers[start - 1]).down_proj, before)
    tokens = random_tokens()
    with torch.no_grad():
        torch.testing.assert_close(folded(tokens).logits, hooked(tokens).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", MOE_ARCHITECTURES)
def test_memory_estimate_counts_every_expert(model_type):
    """The plan's model size is the parameters HF builds: every expert, the router, biases and sinks."""
    config = tiny_config(model_type, num_hidden_layers=3)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert shape_bytes(ModelShape.from_config(config), 2) == 2 * sum(p.numel() for p in model.parameters())
    assert ModelShape.from_config(config).num_experts == 4


@pytest.mark.parametrize("model_type, config, phrase", [
    ("deepseek_v3", {}, "multi-head latent attention"),
    ("qwen3_next", {}, "hybrid linear attention"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "dense MLP layers among the MoE layers"),
])
def test_an_unhandled_moe_feature_is_refused_at_validation_naming_it(tmp_path, capsys, model_type, config, phrase):
    directory = tmp_path / "model"
    AutoConfig.for_model(model_type, **config).save_pretrained(directory)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path, directory, ["ShortGPT<n:1>"])))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and phrase in err and "\n" not in err


@pytest.mark.parametrize("model_type", MOE_ARCHITECTURES)
def test_lora_on_the_expert_roles_is_refused_at_validation(tmp_path, capsys, model_type):
    save_tiny_model(tmp_path / "model", model_type, num_hidden_layers=2)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path, tmp_path / "model", ["LoRARecovery<targets:[q_proj,down_proj]>"])))
    capsys.readouterr()
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: step 0 (LoRARecovery): field 'targets': {model_type}'s MLP is a mixture of "
                          f"experts"), err
    assert "\n" not in err


def test_depth20_auto_on_gpt_oss_skips_the_refused_merges_and_writes_a_stock_checkpoint(tmp_path):
    """The shipped auto recipe on a tiny gpt-oss (sliding/global layers, attention sinks, expert biases): the
    alternatives that merge layers are skipped with their reason, the winner reloads with stock
    ``from_pretrained`` and the engine's logits."""
    save_tiny_model(tmp_path / "model", "gpt_oss", num_hidden_layers=5)
    shipped = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "depth20_auto.yaml").read_text())
    data = recipe(tmp_path, tmp_path / "model", shipped["modifiers"])
    data["calibration"].update(samples=16, seq_len=128)
    result, report = recipe_engine.apply(data, progress=False)
    outcome = report.steps[0].result
    refused = [a for a in outcome["alternatives"] if "refused" in a]
    assert len(refused) == 3 and all("mixture of 4 experts" in a["refused"] for a in refused)
    assert report.stock_checkpoint and report.after.layers == 4
    tokens = random_tokens(vocab=BYTE_VOCAB)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, result(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def moe_resumes(tmp_path_factory):
    """A tiny Mixtral (per-expert names on disk) killed between steps and inside a shared pass (GPTQ on every
    expert, some falling back to round-to-nearest, packed: the resume checkpoints keep the experts' scales), in
    memory and streamed, then resumed (``tests/resume_driver.py``: imports paid once, one forked child per run)."""
    from tests.test_resume import ENV

    base = tmp_path_factory.mktemp("moe_resume")
    save_tiny_model(base / "model", "mixtral", num_hidden_layers=4)
    data = recipe(base, base / "model", ["FuseNorm", "PauseStep", "ReplaceMe<n:1>", "PauseInPass",
                                         "GPTQ<group_size:16,experts:routed,min_expert_tokens:40>"])
    (base / "recipe.yaml").write_text(yaml.safe_dump(data, sort_keys=False))

    def apply(name, *extra):
        return {"name": name, "argv": ["apply", str(base / "recipe.yaml"), "--output", str(base / "out" / name),
                                       "--quiet", "--checkpoint-budget", "1", *extra]}

    cases = []
    for mode, extra in {"memory": (), "streamed": ("--set", "stream='on'")}.items():
        cases.append(apply(f"{mode}_reference", *extra))
        for point in ("step", "pass"):
            killed = apply(f"{mode}_{point}", *extra)
            cases.append({**killed, "name": f"{mode}_kill_{point}", "pause": point,
                          "then": [{**killed, "name": f"{mode}_resume_{point}",
                                    "argv": [*killed["argv"], "--resume"]}]})
    (base / "cases.json").write_text(json.dumps(cases))
    driver = Path(__file__).with_name("resume_driver.py")
    subprocess.run([sys.executable, str(driver), str(base / "cases.json")], env=ENV, check=True, timeout=600)
    return base


@pytest.mark.parametrize("mode", ["memory", "streamed"])
@pytest.mark.parametrize("point", ["step", "pass"])
def test_a_killed_moe_run_resumes_to_the_same_bytes(moe_resumes, mode, point):
    rc = lambda name: int((moe_resumes / f"{name}.rc").read_text())
    assert rc(f"{mode}_reference") == 0 and rc(f"{mode}_kill_{point}") == -9
    assert rc(f"{mode}_resume_{point}") == 0, (moe_resumes / f"{mode}_resume_{point}.err").read_text()
    out, reference = moe_resumes / "out" / f"{mode}_{point}", moe_resumes / "out" / f"{mode}_reference"
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    report = json.loads((out / "report.json").read_text())
    assert report["resumed"] is not None
    reference_report = json.loads((reference / "report.json").read_text())
    # the experts that fell back are counted from the log, the killed run's layers included
    assert report["steps"][-1]["result"]["experts"] == reference_report["steps"][-1]["result"]["experts"]
    assert any(".experts.0.w1.weight_packed" in name for name in disk_names(out))  # the Hub's names, packed


#: Data-parallel jobs on a tiny Qwen3-MoE (6 windows = 3 batches of 2, split 1 + 2 between the ranks).
DP_JOBS = {"sleb": ["SLEB<n:1>"], "replace_me": ["FuseNorm", "ReplaceMe<n:1>"]}


@pytest.fixture(scope="module")
def moe_two_ranks(tmp_path_factory):
    """Each job with 2 gloo ranks (``tests/dp_driver.py``, one launch) and in this process."""

    base = tmp_path_factory.mktemp("moe_dp")
    save_tiny_model(base / "model", "qwen3_moe", num_hidden_layers=4)
    jobs = []
    for name, steps in DP_JOBS.items():
        data = recipe(base, base / "model", steps, name=name)
        data["calibration"]["samples"] = 6
        (base / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        jobs.append({"name": name, "argv": ["apply", str(base / f"{name}.yaml"), "--output",
                                            str(base / "dp" / name), "--quiet"]})
    (base / "jobs.json").write_text(json.dumps(jobs))
    ranks = spawn_two_ranks(base / "jobs.json")
    try:
        for name in DP_JOBS:
            recipe_engine.apply(str(base / f"{name}.yaml"), progress=False)
    finally:
        codes = [rank.wait(timeout=300) for rank in ranks]
    assert codes == [0, 0], [(base / f"{j}.rank{r}.err").read_text() for j in DP_JOBS for r in range(2)]
    return base


@pytest.mark.parametrize("name", list(DP_JOBS))
def test_two_ranks_write_what_one_process_writes(moe_two_ranks, name):
    """The ranks' reduced statistics choose the same layers and fold the same map (fp64 sums in another
    order: relative differences ≤ 1e-6), and the output loads with stock ``from_pretrained``."""
    dp, single = moe_two_ranks / "dp" / name, moe_two_ranks / name
    dp_report, single_report = recipe_engine.load_report(dp), recipe_engine.load_report(single)
    assert dp_report.ranks == 2 and single_report.ranks == 1
    for a, b in zip(dp_report.steps, single_report.steps):
        assert_same_choices(a.result, b.result, f"step {b.index}")
    with safe_open(str(dp / "model.safetensors"), "pt") as a, safe_open(str(single / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in b.keys():
            expected = b.get_tensor(key).double()
            difference = (a.get_tensor(key).double() - expected).abs().max()
            assert difference <= 1e-6 * expected.abs().max().clamp_min(1e-30), key
    assert dp_report.calibration_layer_batches < single_report.calibration_layer_batches
    AutoModelForCausalLM.from_pretrained(dp)


@pytest.mark.parametrize("export", ["dequantized", "compressed-tensors"])
def test_gptq_on_the_attention_of_an_moe_model_reloads_with_its_logits(tmp_path, export):
    """GPTQ on the attention linears (the expert tensors are refused as targets): the output, dense or packed
    (compressed-tensors, which transformers loads with the fused expert names), reloads with ``from_pretrained``
    and the engine's logits."""
    save_tiny_model(tmp_path / "model", "mixtral", num_hidden_layers=2)
    steps = [f"GPTQ<targets:[q_proj,k_proj,v_proj,o_proj],group_size:32,export:{export}>"]
    result, _ = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", steps), progress=False)
    tokens = random_tokens(vocab=BYTE_VOCAB)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, result(tokens).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("targets", ["targets:[q_proj,k_proj,v_proj,o_proj],", ""], ids=["named", "default"])
def test_lora_recovery_on_the_attention_of_an_moe_model_merges_into_a_stock_checkpoint(tmp_path, targets):
    """Named, or by default (every linear the model has: the attention's, as peft's ``all-linear``), the
    attention linears get adapters and merge; the expert tensors are left as they were."""
    model = save_tiny_model(tmp_path / "model", "qwen3_moe", num_hidden_layers=3)
    steps = ["ShortGPT<n:1>", f"LoRARecovery<{targets}max_steps:2,batch_size:2,micro_batch_size:2,lr:0.01>"]
    result, report = recipe_engine.apply(recipe(tmp_path, tmp_path / "model", steps), progress=False)
    assert report.stock_checkpoint
    assert report.steps[1].result["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    removed = {origin for block in report.steps[0].result["removed"] for origin in block}
    kept = [index for index in range(3) if index not in removed]
    assert len(kept) == len(result.model.layers) == 2
    for layer, index in zip(result.model.layers, kept):  # attention trained and merged, experts untouched
        original = model.model.layers[index]
        assert not any("lora" in name for name, _ in layer.named_parameters())
        assert not torch.equal(layer.self_attn.q_proj.weight, original.self_attn.q_proj.weight)
        assert torch.equal(layer.mlp.experts.down_proj, original.mlp.experts.down_proj)
        assert torch.equal(layer.mlp.experts.gate_up_proj, original.mlp.experts.gate_up_proj)
    tokens = random_tokens(vocab=BYTE_VOCAB)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, result(tokens).logits, rtol=1e-4, atol=1e-4)
