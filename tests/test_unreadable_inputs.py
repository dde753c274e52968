"""Inputs the model or torch cannot read are refused up front, in one line, by ``validate`` and ``apply``
alike (and ``eval`` for its ``--seq-len``), before any weight loads: windows longer than the model's context,
integers outside what torch takes as a seed or a count, output names the file system cannot hold."""
import json
import os

import pytest
import torch
import yaml

from recipe_engine.cli import main
from tests.helpers import forbid_loading, refused_in_one_line

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
    return refused_in_one_line(capsys, main, argv, *fragments)


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


LACO = {"LaCo": {"samples": 5, "C": 2}}


@pytest.mark.parametrize("command", ["validate", "apply"])
@pytest.mark.parametrize("steps,fragment", [
    ([LACO], "step 0 (LaCo): field 'samples': samples=5 exceeds the 4 calibration windows"),
    ([{"BestOf": {"alternatives": [["ShortGPT<n:1>"], [{"LaCo": {"samples": 4, "C": 2}}]]}}],
     "alternative 1, step 0 (LaCo) on the 3 fit windows: samples=4 exceeds the 3 calibration windows"),
    (["ShortGPT<n:1>", {"LoRARecovery": {"dataset": "./no-such-alpaca.txt", "max_steps": 1}}],
     "step 1 (LoRARecovery): field 'dataset': data not found: ./no-such-alpaca.txt"),
    ([{"BestOf": {"alternatives": [["ShortGPT<n:1>"],
                                   ["ShortGPT<n:1>", {"LoRARecovery": {"dataset": "./none.jsonl"}}]]}}],
     "field 'alternatives.1.1.dataset': alternative 1, step 1 (LoRARecovery): data not found: ./none.jsonl"),
])
def test_step_inputs_are_checked_before_loading(write_recipe, capsys, command, steps, fragment):
    """A step's own reading of the calibration windows or of a data file, checked with the recipe."""
    refused(capsys, [command, write_recipe(modifiers=steps)], fragment)


def test_shard_index_naming_a_missing_shard(tmp_path, capsys, monkeypatch):
    from tests.helpers import save_tiny_model

    forbid_loading(monkeypatch, "the model was loaded before the missing shard was found")
    save_tiny_model(tmp_path / "m", max_shard_size="40KB")
    shards = sorted((tmp_path / "m").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    capsys.readouterr()
    refused(capsys, ["eval", str(tmp_path / "m"), "--no-ppl", "--tasks", "arc_easy"],
            f"names the shard {shards[-1].name}, which is missing from {tmp_path / 'm'}")


@pytest.mark.parametrize("argv,fragment", [
    (["eval", "{model}", "--no-ppl"], "--no-ppl with no --tasks leaves nothing to evaluate"),
    (["eval", "{model}", "--no-ppl", "--tasks"], "--no-ppl with no --tasks leaves nothing to evaluate"),
    (["sweep", "{recipe}", "--vary", "n=1,2", "--vary", "n=3", "--output", "sw"],
     "--vary n: 'modifiers.0.n' is varied twice"),
    (["sweep", "{recipe}", "--vary", "n=1", "--vary", "modifiers.0.n=1", "--output", "sw"], "is varied twice"),
    (["apply", "{recipe}", "--model", ""], "field 'model': empty model name ''"),
    (["validate", "{recipe}", "--model", " "], "field 'model': empty model name ' '"),
    (["eval", ""], "empty model name ''"),
    (["bench", "{model}", "--prefill-tokens", "250", "--gen-tokens", "7"],
     "(--prefill-tokens / --prompt-tokens + --gen-tokens): seq_len 257 exceeds the model's context of 256 tokens"),
    (["eval", "{model}", "--seq-len", "1"], "--seq-len 1: a perplexity window needs at least 2 tokens"),
    (["validate", "{recipe}", "--set", "evaluate={perplexity: {seq_len: 1}}"],
     "field 'evaluate.perplexity.seq_len': Input should be greater than or equal to 2"),
    (["apply", "{recipe}", "--set", "calibration.seq_len=1"],
     "field 'calibration.seq_len': Input should be greater than or equal to 2"),
])
def test_command_line_mistakes_are_one_line(write_recipe, model_dir, capsys, argv, fragment):
    recipe = write_recipe()
    argv = [a.replace("{model}", str(model_dir)).replace("{recipe}", recipe) for a in argv]
    refused(capsys, argv, fragment)


def test_a_gguf_file_that_cannot_be_read_is_one_line(tmp_path):
    """An unreadable GGUF (here a directory by that name; as another user, a root-owned 0600 cache file) is a
    SourceError naming it, not a traceback."""
    from recipe_engine.errors import SourceError
    from recipe_engine.formats.gguf.source import gguf_cache_dir

    unreadable = tmp_path / "model.gguf"
    unreadable.mkdir()
    with pytest.raises(SourceError, match=f"cannot read the GGUF file {unreadable}"):
        gguf_cache_dir(unreadable)
