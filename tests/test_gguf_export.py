"""GGUF export: read back by readers we did not write (transformers ``gguf_file=``, llama.cpp when installed)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import recipe_engine
from recipe_engine.cli import main
from recipe_engine.errors import RecipeError
from recipe_engine.formats.gguf.writer import export_gguf
from tests.helpers import requires_smollm2, tiny_model

VOCAB = 259  # 256 byte symbols, "he" (one merge: llama.cpp needs merges), "<|eos|>" (special), "<tool>"


def bpe_tokenizer():
    """A saveable byte-level BPE tokenizer with GPT-2's pre-tokenizer regex (llama.cpp's "gpt-2")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["he"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eos|>", pad_token="<|eos|>")
    tokenizer.add_tokens([AddedToken("<tool>", special=False)])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<|eos|>{% endfor %}"
    return tokenizer


def saved(tmp_path, arch="llama", **overrides):
    model = tiny_model(arch, vocab_size=VOCAB, **overrides)
    directory = tmp_path / "model"
    model.save_pretrained(directory)
    bpe_tokenizer().save_pretrained(directory)
    return model, directory


def read_back(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def relative_error(model, other) -> float:
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(ids).logits, other(ids).logits
    return float((a - b).norm() / a.norm())


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True), ("mistral", False)])
@pytest.mark.parametrize("kind,tolerance", [("f32", 1e-6), ("f16", 1e-3)])
def test_transformers_reads_back_the_same_logits(tmp_path, arch, tied, kind, tolerance):
    """transformers undoes the Llama q/k rope permutation and maps names with its own tables."""
    model, directory = saved(tmp_path, arch, tie_word_embeddings=tied)
    summary = export_gguf(directory, tmp_path / "out" / "m.gguf", kind, name="tiny")
    assert summary["architecture"] == {"qwen2": "qwen2"}.get(arch, "llama")
    back = read_back(tmp_path / "out" / "m.gguf")
    assert back.config.tie_word_embeddings == tied
    assert relative_error(model, back) < tolerance


@pytest.mark.parametrize("kind,tolerance", [("bf16", 1e-2), ("q8_0", 3e-2)])
def test_lossy_types_stay_close(tmp_path, kind, tolerance):
    model, directory = saved(tmp_path)
    export_gguf(directory, tmp_path / "m.gguf", kind)
    assert relative_error(model, read_back(tmp_path / "m.gguf")) < tolerance


def test_tokenizer_metadata(tmp_path):
    import gguf

    _, directory = saved(tmp_path)
    export_gguf(directory, tmp_path / "m.gguf", "f32")
    fields = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    tokenizer = bpe_tokenizer()
    assert tokens == [tokenizer.convert_ids_to_tokens(i) for i in range(VOCAB)]
    types = fields["tokenizer.ggml.token_type"].contents()
    assert types[257] == gguf.TokenType.CONTROL and types[258] == gguf.TokenType.USER_DEFINED
    assert set(types[:257]) == {gguf.TokenType.NORMAL}
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 257
    assert fields["tokenizer.ggml.merges"].contents() == ["h e"]
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert fields["tokenizer.chat_template"].contents() == tokenizer.chat_template
    assert fields["llama.attention.head_count_kv"].contents() == 2


def test_refusals_are_one_line(tmp_path):
    _, directory = saved(tmp_path)
    (directory / "recipe_extras.json").write_text(json.dumps([{"modifier": "LinearPatch", "config": {}}]))
    with pytest.raises(RecipeError, match="recipe extras \\(LinearPatch\\)"):
        export_gguf(directory, tmp_path / "a.gguf")
    (directory / "recipe_extras.json").unlink()
    config = json.loads((directory / "config.json").read_text())
    for change, message in (({"quantization_config": {"quant_method": "compressed-tensors"}},
                             "not one the engine reads"),
                            ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                             "rope scaling"),
                            ({"intermediate_size": 80}, "do not match its config.json .*: mis-shaped 12 tensor")):
        (directory / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(RecipeError, match=message) as caught:
            export_gguf(directory, tmp_path / "a.gguf")
        assert "\n" not in str(caught.value)
    assert not list(tmp_path.glob("*.gguf"))


def test_write_is_atomic(tmp_path, monkeypatch):
    """A failure while tensors are written leaves neither the file nor its temporary sibling."""
    import recipe_engine.formats.gguf.writer as module

    _, directory = saved(tmp_path)
    calls = []

    def failing(tensor, qtype):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return original(tensor, qtype)

    original = module._encoding
    monkeypatch.setattr(module, "_encoding", failing)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(directory, tmp_path / "out.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_cli_export(tmp_path, capsys):
    _, directory = saved(tmp_path)
    target = str(tmp_path / "m.gguf")
    assert main(["export", str(directory), "--format", "gguf", "--output", target, "--type", "f32"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["export", str(directory), "--format", "gguf", "--output", target]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(directory), "--format", "gguf", "--output", target, "--force"]) == 0


def test_recipe_export_field(tmp_path):
    """``export: {format: gguf}`` writes the file into the output directory from what was written; a step
    whose output GGUF cannot hold is refused before anything runs."""
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    model = tiny_model(vocab_size=VOCAB)
    recipe = dict(version=1, name="gguf-test", model="tiny", device="cpu", output=str(tmp_path / "out"),
                  calibration=dict(dataset=str(text), samples=4, seq_len=32, batch_size=2),
                  modifiers=["ShortGPT<n:1>"], export={"format": "gguf", "type": "f32"})
    pruned, report = recipe_engine.apply(recipe, model=model, tokenizer=bpe_tokenizer(), progress=False)
    assert report.export.file == "model.gguf"
    back = read_back(tmp_path / "out" / "model.gguf")
    assert back.config.num_hidden_layers == 3
    assert relative_error(pruned, back) < 1e-6
    refused = dict(recipe, output=str(tmp_path / "out2"), modifiers=["ShortGPT<n:1>", "LinearPatch"])
    with pytest.raises(RecipeError, match="LinearPatch.*GGUF cannot express"):
        recipe_engine.apply(refused, model=tiny_model(vocab_size=VOCAB), tokenizer=bpe_tokenizer(), progress=False)
    assert not (tmp_path / "out2").exists()


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama.cpp reader not installed: pip install 'recipe-engine[gguf]' (builds llama.cpp)")
def test_llama_cpp_computes_the_same_logits(tmp_path):
    """llama.cpp's own loader and graph (via llama-cpp-python) on the exported file, f32, token ids in."""
    from llama_cpp import Llama

    for arch in ("llama", "qwen2"):
        model, directory = saved(tmp_path / arch, arch, tie_word_embeddings=arch == "qwen2")
        export_gguf(directory, tmp_path / arch / "m.gguf", "f32")
        ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(2))
        llm = Llama(str(tmp_path / arch / "m.gguf"), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
        llm.eval(ids.tolist())
        theirs = torch.tensor(llm.scores[: len(ids)])
        with torch.no_grad():
            ours = model(ids[None]).logits[0]
        # llama.cpp keeps its KV cache in f16 by default: agreement to ~3e-4 relative, same argmax
        assert float((ours - theirs).norm() / ours.norm()) < 1e-3, arch
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), arch


@requires_smollm2
def test_smollm2_output_exports_the_source_gguf_vocabulary(tmp_path):
    """A recipe on the builtin SmolLM2 with ``export: gguf`` (checked in the pre-flight, written at the end)
    and ``recipe export`` of its output both write the source GGUF's own vocabulary (its ``smollm``
    pre-tokenizer, tokens, merges, special ids), and transformers reads back the output's logits and token ids."""
    import gguf
    from transformers import AutoTokenizer

    from recipe_engine.formats.gguf.source import builtin_gguf

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nname: smol-gguf\nmodel: smollm2-135m\ndevice: cpu\noutput: {tmp_path / 'out'}\n"
                      f"calibration: {{dataset: wikipedia-sample, samples: 2, seq_len: 32, batch_size: 2}}\n"
                      f"modifiers: ['ShortGPT<n:27>']\nexport: {{format: gguf, type: f32}}\n")
    assert main(["apply", str(recipe), "--quiet"]) == 0
    assert main(["export", str(tmp_path / "out"), "--format", "gguf", "--output", str(tmp_path / "m.gguf"),
                 "--type", "f32"]) == 0
    assert recipe_engine.load_report(tmp_path / "out").model.gguf == str(builtin_gguf("smollm2-135m"))
    source = gguf.GGUFReader(str(builtin_gguf("smollm2-135m"))).fields
    for exported in (tmp_path / "out" / "model.gguf", tmp_path / "m.gguf"):
        fields = gguf.GGUFReader(str(exported)).fields
        for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                    "tokenizer.ggml.token_type", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
            assert fields[key].contents() == source[key].contents(), key
        assert fields["llama.block_count"].contents() == 3
    pruned = recipe_engine.load_model(str(tmp_path / "out"))[0]
    ids = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = pruned(ids).logits, read_back(tmp_path / "m.gguf")(ids).logits
    assert float((ours - theirs).norm() / ours.norm()) < 1e-5
    sample = "Über 12 foxes  jumped,\nthe <|im_end|> end."
    assert (AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")(sample).input_ids
            == AutoTokenizer.from_pretrained(str(tmp_path / "out"))(sample).input_ids)


def test_tokenizer_refusals_name_the_form_not_the_output(tmp_path, capsys):
    """A byte-fallback BPE with an empty normalizer Sequence is refused in one line that names the forms
    (no JSON cut mid-way), blames no output field, and a recipe exporting it is refused before loading."""
    _, directory = saved(tmp_path)
    data = json.loads((directory / "tokenizer.json").read_text())
    data["model"]["byte_fallback"] = True
    data["normalizer"] = {"type": "Sequence", "normalizers": []}
    (directory / "tokenizer.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["export", str(directory), "--format", "gguf", "--output", str(tmp_path / "a.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "normalizer Sequence[] with pre-tokenizer ByteLevel" in err, err
    assert "field 'output'" not in err and "{" not in err
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nname: x\nmodel: {directory}\ndevice: cpu\noutput: {tmp_path / 'out'}\n"
                      f"calibration: {{dataset: wikipedia-sample, samples: 2, seq_len: 32}}\n"
                      f"modifiers: ['ShortGPT<n:1>']\nexport: {{format: gguf}}\n")
    assert main(["validate", str(recipe)]) == 2
    assert "field 'export': GGUF export: normalizer Sequence[]" in capsys.readouterr().err
    assert not (tmp_path / "a.gguf").exists()


def test_another_tools_report_is_not_read_as_ours(tmp_path):
    """Only a recipe output's report.json names a source GGUF; a directory with some other report.json
    exports its tokenizer.json's vocabulary."""
    import gguf

    _, directory = saved(tmp_path)
    (directory / "report.json").write_text(json.dumps({"model": {"spec": "smollm2-135m", "kind": "builtin"}}))
    export_gguf(directory, tmp_path / "m.gguf", "f32")
    assert len(gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["tokenizer.ggml.tokens"].contents()) == VOCAB
