"""Inputs the model or torch cannot read are refused up front, in one line, by ``validate`` and ``apply``
alike (and ``eval`` for its ``--seq-len``), before any weight loads: windows longer than the model's context,
integers outside what torch takes as a seed or a count, output names the file system cannot hold."""
import json
import os

import pytest
import torch
import yaml

from recipe_engine.cli import main
from tests.helpers import forbid_loading

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture
def write_recipe(tmp_path, model_dir, monkeypatch):
    (tmp_path / "cal.txt").write_text(TEXT * 10)
    monkeypatch.chdir(tmp_path)
    forbid_loading(monkeypatch, "the model was loaded before the input was refused")

    def write(**changes):
        recipe = {"version": 1, "name": "t", "model": str(model_dir), "output": str(tmp_path / "out"),
                  "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4, "seq_len": 32},
                  "modifiers": ["ShortGPT<n:1>"]}
        for path, value in changes.items():
            *parents, last = path.split(".")
            node = recipe
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = value
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
        return str(tmp_path / "r.yaml")

    return write


def refused(capsys, argv, *fragments):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err[0], err
    return err[0]


def context(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]


@pytest.mark.parametrize("command", ["validate", "apply"])
@pytest.mark.parametrize("field", ["calibration.seq_len", "evaluate.perplexity.seq_len"])
def test_windows_longer_than_the_context(write_recipe, model_dir, capsys, command, field):
    limit = context(model_dir)
    changes = {field: limit + 1}
    if field.startswith("evaluate"):
        changes["evaluate.perplexity.dataset"] = ["cal.txt"]
    refused(capsys, [command, write_recipe(**changes)], f"field '{field}': seq_len {limit + 1} exceeds the "
                                                        f"model's context of {limit} tokens")
    assert main(["validate", write_recipe(**{field: limit})]) == 0  # the context itself is fine


def test_eval_seq_len_longer_than_the_context(model_dir, tmp_path, capsys, monkeypatch):
    forbid_loading(monkeypatch, "the model was loaded before the input was refused")
    (tmp_path / "cal.txt").write_text(TEXT * 10)
    limit = context(model_dir)
    refused(capsys, ["eval", str(model_dir), "--dataset", str(tmp_path / "cal.txt"), "--seq-len", str(limit + 1)],
            f"--seq-len: seq_len {limit + 1} exceeds the model's context of {limit} tokens")


@pytest.mark.parametrize("command", ["validate", "apply"])
@pytest.mark.parametrize("field,value,reference", [
    ("calibration.seed", 10**23, lambda v: torch.Generator().manual_seed(v)),
    ("calibration.seed", 2**64, lambda v: torch.Generator().manual_seed(v)),
    ("calibration.seed", -2**63 - 1, lambda v: torch.Generator().manual_seed(v)),
    ("calibration.samples", 2**63, torch.randperm),
    ("calibration.batch_size", 10**19, torch.randperm)])
def test_integers_torch_cannot_take(write_recipe, capsys, command, field, value, reference):
    """torch itself refuses these (the reference), so the run would die after loading the model."""
    with pytest.raises((RuntimeError, ValueError, OverflowError)):
        reference(value)
    refused(capsys, [command, write_recipe(**{field: value})], f"field '{field}'",
            "outside the 64-bit integer range torch reads")


def test_a_modifier_integer_outside_int64(write_recipe, capsys):
    refused(capsys, ["validate", write_recipe(modifiers=[{"SLEB": {"n": 1, "search_samples": 10**23}}])],
            "step 0 (SLEB): field 'search_samples'", "outside the 64-bit integer range")


def test_largest_int64_seed_is_accepted(write_recipe, capsys):
    torch.Generator().manual_seed(2**63 - 1)
    assert main(["validate", write_recipe(**{"calibration.seed": 2**63 - 1})]) == 0


@pytest.mark.parametrize("command", ["validate", "apply"])
@pytest.mark.parametrize("length", [245, 300])
def test_output_names_the_file_system_cannot_hold(write_recipe, tmp_path, capsys, command, length):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    name = "o" * length
    refused(capsys, [command, write_recipe(output=str(tmp_path / name))], "field 'output'",
            f"its name is {length} bytes; {tmp_path} holds names up to {limit} bytes")
    assert not (tmp_path / name[:limit]).exists()


def test_longest_output_name_that_fits(write_recipe, tmp_path, capsys):
    """The longest accepted name leaves room for '.NAME.tmp-XXXXXXXX': the directory apply really writes."""
    name = "o" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 14)
    os.mkdir(tmp_path / f".{name}.tmp-12345678")  # the file system holds the longest sibling
    assert main(["validate", write_recipe(output=str(tmp_path / name))]) == 0
