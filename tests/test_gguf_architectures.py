"""GGUF export of every architecture with GGUF facts in its adapter (Qwen3, Gemma 3 text, Phi-3 beside the
Llama-family tests of ``test_gguf_export.py``): read back by transformers (``gguf_file=``) and by
``gguf.GGUFReader``, the adapters' name maps checked against gguf-py's own tables, the SentencePiece-style
vocabulary read back by transformers' GGUF tokenizer, and the per-architecture refusals."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from recipe_engine.architectures.adapters import ADAPTERS
from recipe_engine.errors import RecipeError
from recipe_engine.formats.gguf.writer import check_config, export_gguf
from recipe_engine.formats.gguf.layout import GGUFLayout, LAYOUTS, gguf_tensors
from tests.helpers import ARCHITECTURES, tiny_config, tiny_model
from tests.test_gguf_export import VOCAB, bpe_tokenizer, read_back, relative_error

#: SentencePiece-style vocabulary of the tests: specials, 256 byte tokens, characters, merged pieces.
CHARACTERS = ["▁", "h", "e", "l", "o", "w", "r", "d"]
PIECES = ["he", "ll", "▁h", "hell", "▁he", "hello", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
SPM_VOCAB = 300  # > the 283 tokens below: the padding ids are written as UNUSED [PAD{i}]


def spm_tokenizer(arch: str):
    """A saveable SentencePiece-style BPE tokenizer (byte fallback, "▁"-escaped spaces), shaped like Gemma 3's
    (specials <pad> <eos> <bos> <unk>, no prefix space) or like Phi-3's (Llama 2's: <unk> <s> </s>, a "▁"
    prepended). Its merges are every split of every piece into two tokens, best piece first, as transformers
    derives them from a SentencePiece model."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import generate_merges

    gemma = arch == "gemma3_text"
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] if gemma else ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + CHARACTERS + PIECES
    vocab = {token: i for i, token in enumerate(tokens)}
    priority = {piece: -rank for rank, piece in enumerate(PIECES)}
    merges = generate_merges(vocab, priority)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    escape = normalizers.Replace(" ", "▁")
    backend.normalizer = escape if gemma else normalizers.Sequence([normalizers.Prepend("▁"), escape])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    names = (dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>") if gemma
             else dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **names)
    tokenizer.add_tokens([AddedToken("<tool>", normalized=False)])
    if not gemma:  # Phi-3's added end-of-text token (llama.cpp looks it up in a Phi-3 file's vocabulary)
        tokenizer.add_tokens([AddedToken("<|endoftext|>", normalized=False, special=True)])
    return tokenizer


def gemma_defaults(**overrides):
    """Gemma 3 settings transformers' GGUF reader assumes (it reads neither the layer pattern, the sliding rope
    base nor query_pre_attn_scalar): its default 6-layer pattern, query_pre_attn_scalar = head_dim = 256."""
    from transformers import Gemma3TextConfig

    return dict(dict(num_hidden_layers=6, head_dim=256, query_pre_attn_scalar=256,
                     layer_types=Gemma3TextConfig(num_hidden_layers=6).layer_types, tie_word_embeddings=True),
                **overrides)


#: per architecture: the tiny model's overrides that transformers' GGUF reader assumes (Qwen3's head_dim is
#: not read from the file: its default, 128)
READABLE = {"qwen3": dict(head_dim=128), "gemma3_text": gemma_defaults(), "phi3": {}}


def saved(tmp_path, arch, tokenizer=None, vocab_size=VOCAB, **overrides):
    model = tiny_model(arch, vocab_size=vocab_size, **overrides)
    directory = tmp_path / arch
    model.save_pretrained(directory)
    (tokenizer or bpe_tokenizer()).save_pretrained(directory)
    return model, directory


@pytest.mark.parametrize("arch", sorted(READABLE))
@pytest.mark.parametrize("kind,tolerance", [("f32", 1e-6), ("f16", 1e-2)])
def test_transformers_reads_back_the_same_logits(tmp_path, arch, kind, tolerance):
    """f32 is exact up to fp32 rounding of Gemma's ``1 + w`` norm gains (transformers subtracts the 1 again);
    f16 rounds every matrix (relative logit error ~5e-4; ~5e-3 for Gemma 3, whose random norm gains near 2
    and sqrt(hidden)-scaled embeddings amplify it)."""
    model, directory = saved(tmp_path, arch, **READABLE[arch])
    summary = export_gguf(directory, tmp_path / "m.gguf", kind, name="tiny")
    assert summary["architecture"] == LAYOUTS.get(arch).arch
    assert relative_error(model, read_back(tmp_path / "m.gguf")) < tolerance


@pytest.mark.parametrize("arch,head_dim", [("qwen3", 16), ("qwen3", 32), ("qwen2_moe", 32)])
def test_a_gguf_source_keeps_its_head_width(tmp_path, monkeypatch, arch, head_dim):
    """transformers' GGUF reader does not map ``attention.key_length`` for Qwen3, Qwen2-MoE (nor Qwen2, Phi-3):
    it builds Qwen3 with its default head width 128 and the others with hidden / heads (64 / 4 = 16 here), so
    the engine's source path (``load_model`` of a ``.gguf``) takes the width from the file. The model it builds
    computes the exported model's logits (f32), where transformers' own reading of the file fails."""
    from recipe_engine.sources.models import load_model

    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "cache"))
    model, directory = saved(tmp_path, arch, head_dim=head_dim,
                             **({"norm_topk_prob": False} if arch == "qwen2_moe" else {}))
    export_gguf(directory, tmp_path / "m.gguf", "f32", name="tiny")
    with pytest.raises(Exception, match="size mismatch|mismatched"):
        read_back(tmp_path / "m.gguf")
    loaded, _, _ = load_model(str(tmp_path / "m.gguf"))
    assert loaded.config.head_dim == head_dim
    assert relative_error(model, loaded.eval()) < 1e-6


def test_gemma3_file_holds_what_llama_cpp_reads(tmp_path):
    """A Gemma 3 with what transformers' reader ignores set away from its defaults: sliding window 8 on layers
    0, 1, 3 (full attention on 2), sliding rope base 20000, final logit soft-cap 30, query_pre_attn_scalar =
    head_dim 16. Every key llama.cpp's gemma3 loader reads, and every tensor — under gguf-py's name for it
    and with the norm weights stored as their gains ``1 + w`` — read back by ``gguf.GGUFReader``."""
    import gguf

    model, directory = saved(tmp_path, "gemma3_text", final_logit_softcapping=30.0,
                             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}})
    export_gguf(directory, tmp_path / "g.gguf", "f32")
    reader = gguf.GGUFReader(str(tmp_path / "g.gguf"))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "gemma3"
    assert fields["gemma3.attention.sliding_window"] == 8
    assert fields["gemma3.attention.sliding_window_pattern"] == [True, True, False, True]
    assert fields["gemma3.rope.freq_base"] == 1e6 and fields["gemma3.rope.freq_base_swa"] == 2e4
    assert fields["gemma3.final_logit_softcapping"] == 30.0
    assert fields["gemma3.attention.key_length"] == fields["gemma3.attention.value_length"] == 16
    assert fields["gemma3.rope.dimension_count"] == 16
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 4)
    state = model.state_dict()
    written = {tensor.name: torch.from_numpy(tensor.data.copy()) for tensor in reader.tensors}
    assert not model.config.tie_word_embeddings and len(written) == len(state)
    for hf_name, value in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        expected = value + 1.0 if hf_name.endswith("norm.weight") else value
        # GGUFReader gives numpy's row-major shape of GGML's (reversed) dimensions: the HF shape
        assert torch.equal(written[name].reshape(value.shape), expected), hf_name


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if LAYOUTS.get(a) is not None])
def test_adapter_name_maps_cover_every_tensor_once(arch):
    """Every tensor of a tiny model has GGUF names from its adapter (one; an MoE layer's stacked gate_up_proj
    two), no two share one, each is a tensor llama.cpp's architecture declares (``gguf.MODEL_TENSORS``), and it
    is the name gguf-py's own HF→GGUF table (``get_tensor_name_map``, the table llama.cpp's converter uses) gives
    (for stacked experts: to its merged per-expert names, ``mlp.experts.gate_proj``)."""
    import gguf

    adapter = ADAPTERS[arch]
    assert LAYOUTS.get(adapter.model_type) is not None, f"{arch} has no GGUF facts"
    state = tiny_model(arch).state_dict()
    names = gguf_tensors(adapter, tiny_config(arch).num_hidden_layers)
    mapped = [(hf, name, role) for hf in state for name, role in names[hf]]  # KeyError: a tensor without a name
    assert len({name for _, name, _ in mapped}) == len(mapped)
    assert all(len(names[hf]) == (2 if hf.endswith("experts.gate_up_proj") else 1) for hf in state)
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == LAYOUTS.get(adapter.model_type).arch)
    declared = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch_id]}
    reference = gguf.get_tensor_name_map(arch_id, tiny_config(arch).num_hidden_layers)
    merged = {"gate_exps": "gate_proj.weight", "up_exps": "up_proj.weight", "down_exps": "down_proj.weight"}
    for hf, name, role in mapped:
        base, suffix = name.rsplit(".", 1)
        assert any(base == d.format(bid=b) for d in declared for b in range(4)) or base in declared, name
        source = f"{hf.rsplit('.', 1)[0]}.{merged[role]}" if role in merged else hf
        assert reference.get_name(source, try_suffixes=(".weight", ".bias")) == name, hf


@pytest.mark.parametrize("arch", ["gemma3_text", "phi3"])
def test_sentencepiece_vocabulary_reads_back(tmp_path, arch):
    """A byte-fallback BPE tokenizer becomes llama.cpp's ``llama`` vocabulary: tokens by id, BYTE / CONTROL /
    USER_DEFINED / UNUSED types, scores from the merge order, the prefix space — and transformers' GGUF
    tokenizer (Phi-3: merges rebuilt from our scores; Gemma: from token order) splits text as the source does."""
    import gguf
    from transformers import AutoTokenizer

    source = spm_tokenizer(arch)
    _, directory = saved(tmp_path, arch, tokenizer=source, vocab_size=SPM_VOCAB, **READABLE[arch])
    export_gguf(directory, tmp_path / "t.gguf", "f32")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(tmp_path / "t.gguf")).fields.items()
              if k.startswith("tokenizer.")}
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.pre"] == "default"
    assert fields["tokenizer.ggml.add_space_prefix"] == (arch == "phi3")
    tokens, types, scores = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    size = len(source)
    assert tokens[:size] == source.convert_ids_to_tokens(list(range(size)))
    assert tokens[size:] == [f"[PAD{i}]" for i in range(size, SPM_VOCAB)]
    specials = 4 if arch == "gemma3_text" else 3
    assert set(types[:specials]) == {gguf.TokenType.CONTROL}
    assert set(types[specials:specials + 256]) == {gguf.TokenType.BYTE}
    tool = source.convert_tokens_to_ids("<tool>")
    assert types[tool] == gguf.TokenType.USER_DEFINED
    if arch == "phi3":  # its added special end-of-text token
        assert types[source.convert_tokens_to_ids("<|endoftext|>")] == gguf.TokenType.CONTROL
    assert set(types[size:]) == {gguf.TokenType.UNUSED}
    pieces = [scores[source.convert_tokens_to_ids(p)] for p in PIECES]
    assert pieces == sorted(pieces, reverse=True) and len(set(pieces)) == len(pieces)  # merge order kept
    characters = {scores[source.convert_tokens_to_ids(c)] for c in CHARACTERS}  # no merge forms them
    assert len(characters) == 1 and characters.pop() < min(pieces)
    unk, eos = ("<unk>", "<eos>") if arch == "gemma3_text" else ("<unk>", "</s>")
    assert fields["tokenizer.ggml.unknown_token_id"] == source.convert_tokens_to_ids(unk)
    assert fields["tokenizer.ggml.eos_token_id"] == source.convert_tokens_to_ids(eos)
    back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    for text in ("hello world", "hello  world", "held low", "héllo wörld", "hello<tool>world"):
        assert back(text, add_special_tokens=False)["input_ids"] == \
            source(text, add_special_tokens=False)["input_ids"], text


def test_unsupported_architecture_is_one_line(tmp_path, monkeypatch):
    """A model_type without an adapter, and an adapter without GGUF facts: one line, nothing written, before
    any weight is read."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(RecipeError, match=r"GGUF export: model_type 'gpt2' is not supported \(supported: llama, "
                                          r"mistral, qwen2, qwen3, gemma3_text, phi3, qwen2_moe, qwen3_moe, "
                                          r"mixtral\)") as caught:
        export_gguf(tmp_path / "gpt2", tmp_path / "a.gguf")
    assert "\n" not in str(caught.value)
    _, directory = saved(tmp_path, "qwen3")
    monkeypatch.delitem(LAYOUTS, "qwen3")
    with pytest.raises(RecipeError, match="model_type 'qwen3' is not supported") as caught:
        export_gguf(directory, tmp_path / "b.gguf")
    assert "\n" not in str(caught.value) and "qwen3," not in caught.value.detail.split("supported:")[1]
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize("arch,change,message", [
    ("qwen3", dict(sliding_window=8, use_sliding_window=True, max_window_layers=0),
     "sliding-window attention is not exported \\(llama.cpp's qwen3 graph attends fully\\)"),
    ("phi3", dict(sliding_window=8), "llama.cpp's phi3 graph attends fully"),
    ("qwen3", dict(final_logit_softcapping=30.0), "soft-capping is not computed by llama.cpp's qwen3 graph"),
    ("phi3", dict(hidden_act="gelu"), "activation 'gelu' is not the 'silu'"),
    ("gemma3_text", dict(query_pre_attn_scalar=64), "query_pre_attn_scalar 64 differs from the 16"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attention logit soft-capping"),
    ("gemma3_text", dict(hidden_activation="gelu"), "activation 'gelu' is not the 'gelu_pytorch_tanh'"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope scaling 'linear'"),
])
def test_per_architecture_refusals(arch, change, message):
    """What each architecture's llama.cpp graph cannot compute, refused in one line from the config alone;
    Gemma 3's sliding windows are written, not refused."""
    with pytest.raises(RecipeError, match=message) as caught:
        check_config(tiny_config(arch, **change))
    assert "\n" not in str(caught.value) and str(caught.value).startswith("GGUF export: ")


def test_gemma3_sliding_windows_and_soft_cap_pass_the_checks():
    check_config(tiny_config("gemma3_text", final_logit_softcapping=30.0))
    assert LAYOUTS.get("gemma3_text").sliding_window and not LAYOUTS.get("qwen3").sliding_window
    assert isinstance(LAYOUTS.get("phi3"), GGUFLayout)


def test_refused_tokenizer_shape(tmp_path):
    """A byte-fallback BPE whose pre-tokenizer splits words (not SentencePiece's "▁" escaping): one line."""
    _, directory = saved(tmp_path, "phi3", tokenizer=spm_tokenizer("phi3"), vocab_size=SPM_VOCAB)
    data = json.loads((directory / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Whitespace"}
    (directory / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(RecipeError, match="is not the '▁' escaping") as caught:
        export_gguf(directory, tmp_path / "t.gguf")
    assert "\n" not in str(caught.value) and not (tmp_path / "t.gguf").exists()


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama.cpp reader not installed: pip install 'recipe-engine[gguf]' (builds llama.cpp)")
@pytest.mark.parametrize("arch,overrides", [
    ("qwen3", {}), ("phi3", {}),
    # mixture of experts: stacked ffn_*_exps, the router, Qwen2-MoE's shared expert
    ("qwen3_moe", dict(norm_topk_prob=True)), ("mixtral", {}), ("qwen2_moe", {}),
    # sliding window 8 < the 20 positions, an irregular pattern, its own rope base, soft-capped logits
    ("gemma3_text", dict(final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention",
                                                                    "sliding_attention", "sliding_attention"],
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}})),
])
def test_llama_cpp_computes_the_same_logits(tmp_path, arch, overrides):
    """llama.cpp's own loader and graph (llama-cpp-python) on the f32 file, token ids in, with an f32 KV cache
    (its default f16 cache alone leaves relative logit errors of ~2e-3). The file is named "tiny": llama.cpp
    treats a model *named* Phi-3 as having Phi-3's own vocabulary (``<s>``, ``</s>``), which this one lacks."""
    from llama_cpp import Llama

    model, directory = saved(tmp_path, arch, **overrides)
    export_gguf(directory, tmp_path / "m.gguf", "f32", name="tiny")
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(2))
    f32 = 0  # ggml's GGML_TYPE_F32
    llm = Llama(str(tmp_path / "m.gguf"), n_ctx=64, logits_all=True, verbose=False, n_threads=1, type_k=f32,
                type_v=f32)
    llm.eval(ids.tolist())
    theirs = torch.tensor(llm.scores[: len(ids)])
    with torch.no_grad():
        ours = model(ids[None]).logits[0]
    assert float((ours - theirs).norm() / ours.norm()) < 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama.cpp reader not installed: pip install 'recipe-engine[gguf]' (builds llama.cpp)")
@pytest.mark.parametrize("arch", ["gemma3_text", "phi3"])
def test_llama_cpp_tokenizes_as_the_source(tmp_path, arch):
    from llama_cpp import Llama

    source = spm_tokenizer(arch)
    _, directory = saved(tmp_path, arch, tokenizer=source, vocab_size=SPM_VOCAB, **READABLE[arch])
    export_gguf(directory, tmp_path / "t.gguf", "f32")
    llm = Llama(str(tmp_path / "t.gguf"), n_ctx=64, verbose=False, n_threads=1, vocab_only=True)
    for text in ("hello world", "hello  world", "held low", "héllo wörld", "hello<tool>world"):
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == \
            source(text, add_special_tokens=False)["input_ids"], text
