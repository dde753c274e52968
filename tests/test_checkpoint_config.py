"""A source checkpoint agrees with its config.json or nothing runs: every tensor the architecture needs is
there with the config's shape and nothing is left over, checked from the safetensors headers before any weight
loads, for every command that reads a model (in memory and streamed, single file and sharded)."""
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from recipe_engine.cli import main
from recipe_engine.checkpoint.reader import check_checkpoint
from tests.helpers import forbid_loading, save_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def _edit_tensors(directory, edit):
    """Apply ``edit`` to the tensors of the (single or sharded) checkpoint, keeping its index consistent."""
    index = directory / "model.safetensors.index.json"
    files = sorted({*json.loads(index.read_text())["weight_map"].values()}) if index.exists() else ["model.safetensors"]
    first = files[0]
    tensors = load_file(str(directory / first))
    edit(tensors)
    save_file(tensors, str(directory / first), metadata={"format": "pt"})
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if v != first}
        data["weight_map"].update({name: first for name in tensors})
        index.write_text(json.dumps(data))


def _more_layers(directory):
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] += 2
    (directory / "config.json").write_text(json.dumps(config))


def _extra(tensors):
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(4, 4)


def _mis_shaped(tensors):
    name = "model.layers.0.mlp.up_proj.weight"
    if name in tensors:
        tensors[name] = torch.zeros(tensors[name].shape[0] - 8, tensors[name].shape[1])


CASES = {"missing": (_more_layers, None, "missing 18 tensor(s): model.layers.4."),
         "extra": (None, _extra, "unexpected 1 tensor(s): model.layers.0.mlp.extra.weight"),
         "mis-shaped": (None, _mis_shaped, "mis-shaped 1 tensor(s): model.layers.0.mlp.up_proj.weight")}


@pytest.fixture(params=[None, "40KB"], ids=["single", "sharded"])
def broken(request, tmp_path_factory):
    """For each case, a tiny checkpoint hand-edited to disagree with its config (``{case: directory}``)."""
    made = {}
    for case, (config_edit, tensor_edit) in ((c, v[:2]) for c, v in CASES.items()):
        directory = tmp_path_factory.mktemp(case)
        save_tiny_model(directory, max_shard_size=request.param)
        if config_edit:
            config_edit(directory)
        if tensor_edit:
            if case == "mis-shaped" and request.param:  # put the tensor in the shard we edit
                index = directory / "model.safetensors.index.json"
                shard = sorted({*json.loads(index.read_text())["weight_map"].values()})[0]
                name = "model.layers.0.mlp.up_proj.weight"
                owner = json.loads(index.read_text())["weight_map"][name]
                tensors = {name: load_file(str(directory / owner))[name]}
                _edit_tensors(directory, lambda t: t.update(tensors))
                rest = {k: v for k, v in load_file(str(directory / owner)).items() if k != name}
                if owner != shard:
                    save_file(rest, str(directory / owner), metadata={"format": "pt"})
            _edit_tensors(directory, tensor_edit)
        made[case] = directory
    return made


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_agrees_the_checkpoint_does_not_match(broken, case):
    """The independent reference: transformers' own loading report finds the same tensors."""
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(broken[case], output_loading_info=True,
                                                   ignore_mismatched_sizes=True)
    named = {"missing": info["missing_keys"], "extra": info["unexpected_keys"],
             "mis-shaped": [k for k, *_ in info["mismatched_keys"]]}[case]
    fragment = CASES[case][2]
    assert any(fragment.split(": ", 1)[1] in name for name in named), (fragment, info)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", ["apply", "apply-stream", "apply-model", "validate", "eval", "bench", "export"])
def test_every_command_refuses_before_loading(broken, case, command, tmp_path, capsys, monkeypatch):
    forbid_loading(monkeypatch, "the model was loaded before the mismatch was found")
    directory = broken[case]
    (tmp_path / "cal.txt").write_text(TEXT)
    recipe = {"version": 1, "name": "t", "model": str(directory), "output": str(tmp_path / "out"),
              "stream": "on" if command == "apply-stream" else "off",
              "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4, "seq_len": 32},
              "modifiers": [{"ShortGPT": {"n": 1}}]}
    if command == "apply-model":
        recipe["model"] = "smollm2-135m"
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    argv = {"apply": ["apply", str(tmp_path / "r.yaml")], "apply-stream": ["apply", str(tmp_path / "r.yaml")],
            "apply-model": ["apply", str(tmp_path / "r.yaml"), "--model", str(directory)],
            "validate": ["validate", str(tmp_path / "r.yaml")],
            "eval": ["eval", str(directory), "--limit", "1"], "bench": ["bench", str(directory)],
            "export": ["export", str(directory), "--format", "gguf", "--output", str(tmp_path / "m.gguf")]}[command]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert "do not match its config.json" in err[0] and CASES[case][2] in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.txt", "r.yaml"]


def test_a_matching_checkpoint_passes(tmp_path):
    from transformers import AutoConfig

    save_tiny_model(tmp_path, tie_word_embeddings=True)
    check_checkpoint(tmp_path, AutoConfig.from_pretrained(tmp_path))


@pytest.mark.parametrize("case", list(CASES))
def test_loading_refuses_what_transformers_would_initialize(broken, case, capfd):
    """The last line of defence (a hub model's files arrive only when it loads): ``load_model`` turns
    transformers' loading report into one error instead of random weights, and its table is not printed."""
    from recipe_engine.errors import SourceError
    from recipe_engine.sources.models import load_model

    capfd.readouterr()
    with pytest.raises(SourceError, match="do not match its config.json") as caught:
        load_model(str(broken[case]))
    assert "\n" not in str(caught.value)
    assert CASES[case][2].split(": ", 1)[0].split(" ")[0] in str(caught.value)
    assert "LOAD REPORT" not in capfd.readouterr().err
