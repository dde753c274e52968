"""GGUF export of a finished output directory, for llama.cpp / Ollama / LM Studio.

Reads only the directory (``config.json``, safetensors weights, ``tokenizer.json`` and its config), and
writes one GGUF file with the ``gguf`` package's writer: architecture metadata, the tokenizer (byte-level BPE
as llama.cpp's ``gpt2`` vocabulary with its merges, or a SentencePiece-style BPE with byte fallback as its
``llama`` vocabulary with scores and token types; special token ids and chat template through
``gguf.SpecialVocab``) and the weights under llama.cpp's tensor names. Tensors are streamed: tensor infos
first (sizes from the shapes), then the data one tensor at a time, into a temporary sibling renamed into place.

Every architecture fact comes from the model's adapter (``adapters.GGUFLayout``: llama.cpp's architecture
name, the tensor name of each role, rope row order, sliding windows, soft-capping, activation, further
config checks); this module names no architecture. Conventions followed (llama.cpp's
``convert_hf_to_gguf.py``, read, not copied): 1-D tensors (norms, biases) stay F32 whatever ``--type``;
q/k rows are reordered from HF's rotate-half layout to GGML's adjacent-pair rope where the graph rotates pairs
(``permute_rope``); norms stored as ``w`` with gain ``offset + w`` (Gemma's ``1 + w``) are written as the gain;
a tied ``lm_head`` is not written (llama.cpp and transformers reuse ``token_embd``). Refused in one line:
anything GGUF or the architecture's llama.cpp graph cannot express — recipe extras (LinearPatch),
compressed-tensors packed weights, tensors that disagree with the config (missing, extra, of another shape:
non-uniform layers), rope scaling, sliding windows where the graph attends
fully, unknown tokenizers and pre-tokenizers.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from ..architectures.adapters import ADAPTERS, ArchitectureAdapter, adapter_for
from ..errors import RecipeError
from ..system.cleanup import track, untrack
from .checkpoint_reader import INDEX_FILE, SINGLE_FILE, check_checkpoint
from .extras import EXTRAS_JSON
from .models import gguf_origin, hub_file, recorded_gguf, resolve_model
from .output import check_file_output, check_free_bytes
from .output_lock import output_lock

TYPES = ("f32", "f16", "bf16", "q8_0")
#: tokenizer.json pre-tokenizer → llama.cpp ``tokenizer.ggml.pre`` (the regex llama.cpp applies before BPE).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _fail(message: str, field: str | None = None) -> RecipeError:
    return RecipeError(f"GGUF export: {message}", field=field)


def _describe(component: dict | None) -> str:
    """A tokenizer.json component by its types, e.g. ``Sequence[Prepend, Replace]`` (``none`` when absent)."""
    if not component:
        return "none"
    inner = component.get("normalizers") or component.get("pretokenizers") or component.get("decoders")
    if component.get("type") == "Sequence":
        return f"Sequence[{', '.join(_describe(step) for step in inner or [])}]"
    return str(component.get("type"))


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """``gpt-2`` for GPT-2's own ByteLevel regex, ``qwen2`` for Qwen2's split + ByteLevel; else refused."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if (len(steps) == 2 and steps[0].get("type") == "Split"
            and steps[0].get("pattern", {}).get("Regex") == QWEN2_SPLIT
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex", True)):
        return "qwen2"
    raise _fail(f"pre-tokenizer {_describe(pre)} is not one llama.cpp names here (known: gpt-2's ByteLevel, "
                f"qwen2's Split + ByteLevel)")


def permute_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotate-half rows ``[x_0..x_{d/2-1}, y_0..y_{d/2-1}]`` per head → GGML's ``[x_0, y_0, x_1, y_1, ...]``
    (llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` rotates adjacent pairs)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _weights(directory: Path) -> dict[str, str]:
    """Tensor name → safetensors file holding it."""
    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        return {name: str(directory / file) for name, file in weight_map.items()}
    if (directory / SINGLE_FILE).is_file():
        with safe_open(str(directory / SINGLE_FILE), "pt") as f:
            return {name: str(directory / SINGLE_FILE) for name in f.keys()}
    raise _fail(f"'{directory}' has no {SINGLE_FILE} or {INDEX_FILE}")


def check_recipe_exportable(recipe, config) -> None:
    """Before anything loads: ``recipe.export`` refused for steps whose output GGUF cannot hold (read from the
    steps' flags: non-stock extras, packed quantized weights) and for an unsupported model config."""
    for index, step in enumerate(recipe.modifiers):
        if not step.stock_output:
            raise _fail(f"step {index} ({step.step_name()}) adds non-stock extras that GGUF cannot express")
        if step.quantizes:
            raise _fail(f"step {index} ({step.step_name()}) writes packed quantized weights that GGUF cannot "
                        f"hold; use its dequantized export and export.type q8_0 if size matters")
    check_config(config)


def check_source_vocabulary(spec: str, vocab_size: int) -> None:
    """Before anything loads: the vocabulary a recipe's ``export:`` writes can be built from the model source
    ``spec`` (its GGUF's metadata, or its ``tokenizer.json``, which the run saves with the output)."""
    source = resolve_model(spec, convert=False)
    origin = gguf_origin(source)
    if origin:
        gguf_vocabulary(Path(origin), vocab_size)
    elif source.kind == "local":
        _vocabulary(Path(source.location), vocab_size)
    elif source.kind == "hub":
        _vocabulary(Path(hub_file(spec, "tokenizer.json")).parent, vocab_size)


def check_exportable(directory: Path, config) -> None:
    """The one-line refusals that need only the directory's files (weights are checked while written)."""
    if (directory / EXTRAS_JSON).is_file():
        names = ", ".join(e["modifier"] for e in json.loads((directory / EXTRAS_JSON).read_text()))
        raise _fail(f"the checkpoint carries recipe extras ({names}) that GGUF cannot express; export a "
                    f"recipe without them")
    if getattr(config, "quantization_config", None):
        raise _fail("compressed-tensors packed weights have no GGUF form; export the dequantized output "
                    "(GPTQ export: dequantized) and pick --type q8_0 if size matters")
    check_config(config)


def gguf_adapter(config) -> ArchitectureAdapter:
    """The adapter of ``config.model_type`` if it has GGUF facts; anything else is one line."""
    adapter = ADAPTERS.get(getattr(config, "model_type", None))
    if adapter is None or adapter.gguf is None:
        supported = ", ".join(t for t, a in ADAPTERS.items() if a.gguf is not None)
        raise _fail(f"model_type {getattr(config, 'model_type', None)!r} is not supported (supported: {supported})")
    try:
        adapter_for(config)  # the variants the engine refuses (attention or MLP biases it does not model)
    except RecipeError as exc:
        raise _fail(exc.detail) from None
    return adapter


def rope_parameters(config) -> dict[str, dict]:
    """Rope parameters per attention kind: ``{"full_attention": {...}, "sliding_attention": {...}}`` as
    transformers nests them for models with layer types (Gemma 3), else ``{"full_attention": the one dict}``."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope and all(isinstance(value, dict) for value in rope.values()):
        return rope
    return {"full_attention": rope}


def sliding_layers(config) -> list[bool] | None:
    """Which layers attend through a sliding window (``config.layer_types``; every layer when the config has a
    window and no layer types), or None when none does (no window, ``use_sliding_window: false``)."""
    if not getattr(config, "sliding_window", None) or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    flags = [kind == "sliding_attention" for kind in types] if types else [True] * config.num_hidden_layers
    return flags if any(flags) else None


def _activation(config) -> str | None:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def check_config(config) -> None:
    """The architecture (its adapter has GGUF facts) and the attention variants its llama.cpp graph computes."""
    layout = gguf_adapter(config).gguf
    for kind, rope in rope_parameters(config).items():
        if rope.get("rope_type", "default") != "default":
            raise _fail(f"rope scaling {rope.get('rope_type')!r} is not exported (needs llama.cpp's rope_freqs)")
    if sliding_layers(config) and not layout.sliding_window:
        raise _fail(f"sliding-window attention is not exported (llama.cpp's {layout.arch} graph attends fully)")
    if getattr(config, "final_logit_softcapping", None) and not layout.final_logit_softcapping:
        raise _fail(f"final logit soft-capping is not computed by llama.cpp's {layout.arch} graph")
    if _activation(config) != layout.activation:
        raise _fail(f"activation {_activation(config)!r} is not the {layout.activation!r} llama.cpp's "
                    f"{layout.arch} graph computes")
    problem = layout.config_problem(config) if layout.config_problem else None
    if problem:
        raise _fail(problem)


def _encoding(tensor: torch.Tensor, qtype) -> np.ndarray:
    """The tensor as the bytes of GGML type ``qtype`` (F32, F16, or BF16/Q8_0 via ``gguf.quants``)."""
    data = tensor.to(torch.float32).contiguous().numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return data
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def _tensor_plan(directory: Path, config, kind: str, adapter) -> list[tuple[str, str, str, tuple[int, ...], object, str]]:
    """``(gguf name, hf name, file, shape, GGML type, role)`` per tensor, in file order (the tensors agree
    with the config: ``check_checkpoint``); refuses tensors llama.cpp has no name for and rows Q8_0 cannot
    block."""
    files = _weights(directory)
    names = adapter.gguf_tensors(config.num_hidden_layers)
    plan, shapes = [], {}
    for file in dict.fromkeys(files.values()):
        with safe_open(file, "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    for hf_name in files:
        shape = shapes[hf_name]
        if hf_name not in names:
            raise _fail(f"no llama.cpp name for tensor {hf_name}")
        gguf_name, role = names[hf_name]
        if len(shape) == 1 or kind == "f32":
            qtype = gguf.GGMLQuantizationType.F32
        else:
            qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
                     "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            if shape[-1] % block:
                raise _fail(f"{hf_name}: row length {shape[-1]} is not a multiple of {kind}'s block {block}")
        plan.append((gguf_name, hf_name, files[hf_name], shape, qtype, role))
    return sorted(plan, key=lambda row: _order(row[0]))


def gguf_tensor(tensor: torch.Tensor, role: str, adapter, config) -> torch.Tensor:
    """An HF tensor as llama.cpp reads it: q/k rows in adjacent-pair rope order where the graph rotates pairs,
    a norm's weight ``w`` as its gain ``norm_offset + w`` (fp32)."""
    if adapter.gguf.rope_adjacent_pairs and role in ("q_proj", "k_proj"):
        heads = config.num_attention_heads
        return permute_rope(tensor, heads if role == "q_proj" else getattr(config, "num_key_value_heads", None) or heads)
    if adapter.norm_offset and (role in adapter.norms or role == "final_norm"):
        return tensor.float() + adapter.norm_offset
    return tensor


def _order(gguf_name: str) -> tuple[int, str]:
    """llama.cpp's usual file order: token_embd, blocks in index order, output_norm, output."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return 1 + int(parts[1]), gguf_name
    return (0 if parts[0] == "token_embd" else 10**9), gguf_name


@dataclass(frozen=True)
class Vocabulary:
    """What ``tokenizer.ggml.*`` holds: llama.cpp's vocabulary ``model`` (``gpt2``: byte-level BPE with merges;
    ``llama``: SentencePiece-style BPE with byte fallback, merge order as scores), its ``pre``-tokenizer, tokens
    by id, their types, and for ``llama`` the scores and whether a space is prepended to the text. ``copied``:
    the source GGUF's other ``tokenizer.*`` keys ``(key, value, type, item type)``, written as they are instead
    of the special tokens and chat template read from the directory."""

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    add_space_prefix: bool | None = None
    copied: tuple | None = None

    def write(self, writer, directory: Path) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.copied is not None:
            for key, value, kind, item in self.copied:
                writer.add_key_value(key, value, kind, item)
            return
        special = gguf.SpecialVocab(directory, load_merges=self.model == "gpt2", n_vocab=len(self.tokens))
        special.add_to_gguf(writer, quiet=True)


#: ``tokenizer.ggml.*`` keys :class:`Vocabulary` writes itself (padded to the model's vocabulary).
OWN_KEYS = {f"tokenizer.ggml.{key}" for key in ("model", "pre", "tokens", "token_type", "scores", "add_space_prefix")}


def gguf_vocabulary(path: Path, vocab_size: int) -> Vocabulary:
    """The vocabulary of the GGUF file ``path`` as its own metadata states it (what llama.cpp read from it,
    whatever tokenizer transformers builds from it), padded to ``vocab_size`` with ``[PAD{i}]`` UNUSED tokens;
    its other ``tokenizer.*`` keys (merges, special ids, chat template) are copied."""
    if not path.is_file():
        raise _fail(f"the checkpoint was converted from {path}, which is gone; its vocabulary is read from "
                    f"there (reinstall or restore it)")
    try:
        fields = {name: field for name, field in gguf.GGUFReader(str(path)).fields.items()
                  if name.startswith("tokenizer.")}
        value = lambda key, default=None: fields[key].contents() if key in fields else default
        model, tokens = value("tokenizer.ggml.model"), value("tokenizer.ggml.tokens")
        types, scores = value("tokenizer.ggml.token_type"), value("tokenizer.ggml.scores")
        copied = tuple((key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
                       for key, field in fields.items() if key not in OWN_KEYS)
        pre, prefix = value("tokenizer.ggml.pre", "default"), value("tokenizer.ggml.add_space_prefix")
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise _fail(f"cannot read the vocabulary of {path}: {type(exc).__name__}: {exc}") from None
    if not model or not tokens or types is None or len(types) != len(tokens):
        raise _fail(f"{path} holds no complete llama.cpp vocabulary (tokenizer.ggml.model, tokens, token_type)")
    if len(tokens) > vocab_size:
        raise _fail(f"{path} has {len(tokens)} tokens but the model's vocabulary is {vocab_size}")
    pad = range(len(tokens), vocab_size)
    return Vocabulary(str(model), str(pre), [*tokens, *(f"[PAD{i}]" for i in pad)],
                      [*map(int, types), *(int(gguf.TokenType.UNUSED) for _ in pad)],
                      None if scores is None else [*map(float, scores), *(-10000.0 for _ in pad)],
                      None if prefix is None else bool(prefix), copied)


def source_gguf(directory: Path) -> Path | None:
    """The GGUF file the checkpoint in ``directory`` was converted from, as its ``report.json`` records it."""
    recorded = recorded_gguf(directory)
    return Path(recorded) if recorded else None


def vocabulary(directory: Path, vocab_size: int, origin: Path | None = None) -> Vocabulary:
    """llama.cpp's vocabulary for the checkpoint in ``directory``: the source GGUF's own (``origin``, else
    the one its ``report.json`` records) when it came from one, else its ``tokenizer.json``'s."""
    origin = origin or source_gguf(directory)
    return gguf_vocabulary(origin, vocab_size) if origin else _vocabulary(directory, vocab_size)


def _vocabulary(directory: Path, vocab_size: int) -> Vocabulary:
    """The tokenizer of ``directory/tokenizer.json`` as llama.cpp's vocabulary, padded to the config's
    vocabulary with ``[PAD{i}]`` tokens of type UNUSED. Byte-level BPE becomes ``gpt2``; a BPE with byte
    fallback over ``▁``-escaped text (Llama 2, Mistral v0.1, Phi-3, Gemma) becomes ``llama``; others are
    refused."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise _fail(f"'{directory}' has no tokenizer.json (a BPE tokenizer is required)")
    data = json.loads(path.read_text(encoding="utf-8"))
    model, decoder = data.get("model") or {}, data.get("decoder") or {}
    if model.get("type") == "BPE" and not model.get("byte_fallback") and decoder.get("type") == "ByteLevel":
        return _byte_level_vocabulary(data, vocab_size)
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return _sentencepiece_vocabulary(data, vocab_size)
    raise _fail("only byte-level BPE (llama.cpp 'gpt2') and byte-fallback BPE (llama.cpp 'llama') tokenizers are "
                f"exported; this one is {model.get('type')} with a {decoder.get('type')} decoder")


def _tokens_by_id(data: dict, vocab_size: int) -> tuple[dict[int, str], dict[int, bool]]:
    """Token text by id (model vocabulary and added tokens) and, for added tokens, whether each is special."""
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    added = {}
    for token in data.get("added_tokens", []):
        by_id[token["id"]] = token["content"]
        added[token["id"]] = bool(token["special"])
    if max(by_id) >= vocab_size:
        raise _fail(f"tokenizer has id {max(by_id)} but the model's vocabulary is {vocab_size}")
    return by_id, added


def _byte_level_vocabulary(data: dict, vocab_size: int) -> Vocabulary:
    """Special added tokens CONTROL, other added tokens USER_DEFINED, ids without a token UNUSED."""
    if not data["model"].get("merges"):
        raise _fail("the BPE tokenizer has no merges; llama.cpp refuses a BPE vocabulary without them")
    pre = pre_tokenizer_name(data)
    by_id, added = _tokens_by_id(data, vocab_size)
    kinds = {i: gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED for i, special in added.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [int(kinds.get(i, gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED))
             for i in range(vocab_size)]
    return Vocabulary("gpt2", pre, tokens, types)


def space_prefix(data: dict) -> bool:
    """Whether the tokenizer prepends ``▁`` to the text before BPE (SentencePiece's ``add_dummy_prefix``):
    read from its normalizer (``Prepend`` + ``Replace(' ', '▁')``, or ``Replace`` alone) or its ``Metaspace``
    pre-tokenizer; other shapes llama.cpp's ``llama`` vocabulary does not reproduce are refused."""
    normalizer, pre = data.get("normalizer") or {}, data.get("pre_tokenizer") or {}
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    steps = [step for step in steps if step]
    kinds = [step.get("type") for step in steps]
    escapes = [step for step in steps if step.get("type") == "Replace"
               and step.get("pattern", {}).get("String") == " " and step.get("content") == "\u2581"]
    # a Split on " " after every space became "▁" splits nothing (Gemma's tokenizer.json has one)
    inert_pre = not pre or (escapes and pre.get("type") == "Split" and pre.get("pattern", {}).get("String") == " ")
    if kinds == ["Prepend", "Replace"] and steps[0].get("prepend") == "\u2581" and escapes and inert_pre:
        return True
    if kinds == ["Replace"] and escapes and inert_pre:
        return False
    if not steps and pre.get("type") == "Metaspace" and pre.get("replacement") == "\u2581" and not pre.get("split"):
        scheme = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never")
        if scheme in ("always", "first", "never"):
            return scheme != "never"
    raise _fail(f"normalizer {_describe(normalizer)} with pre-tokenizer {_describe(pre)} is not the '▁' escaping "
                f"llama.cpp's SentencePiece-style vocabulary applies")


def _sentencepiece_vocabulary(data: dict, vocab_size: int) -> Vocabulary:
    """llama.cpp's ``llama`` vocabulary merges the adjacent pair whose concatenation is the token with the
    highest score; HF's BPE merges the pair of lowest rank in ``merges``. So a token's score is minus the rank
    of the first merge that forms it (tokens no merge forms score below all of them); ``<0xXX>`` tokens are
    BYTE, special added tokens CONTROL, other added tokens USER_DEFINED (score -1000, as llama.cpp's converter
    writes them), ids without a token UNUSED."""
    add_space_prefix = space_prefix(data)
    by_id, added = _tokens_by_id(data, vocab_size)
    merges = data["model"].get("merges") or []
    first_merge = {}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        first_merge.setdefault(left + right, rank)
    unmerged = -float(len(merges) + 1)
    tokens, types, scores = [], [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            kind, score, token = gguf.TokenType.UNUSED, -10000.0, f"[PAD{i}]"
        elif i in added:
            kind, score = (gguf.TokenType.CONTROL if added[i] else gguf.TokenType.USER_DEFINED), -1000.0
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            kind, score = gguf.TokenType.BYTE, 0.0
        else:
            kind, score = gguf.TokenType.NORMAL, -float(first_merge[token]) if token in first_merge else unmerged
        tokens.append(token)
        types.append(int(kind))
        scores.append(score)
    return Vocabulary("llama", "default", tokens, types, scores, add_space_prefix)


def _metadata(writer, config, kind: str, name: str) -> None:
    """The ``{arch}.*`` keys llama.cpp reads: sizes, head counts and length, norm epsilon, rope base and rotated
    dimensions; sliding window, its per-layer pattern and the sliding layers' rope base, and the final logit
    soft-cap where the config has them (``check_config`` refused them where the graph does not compute them)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = rope_parameters(config)
    full = rope["full_attention"]
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(full["rope_theta"]))
    writer.add_rope_dimension_count(int(head_dim * full.get("partial_rotary_factor", 1.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    sliding = sliding_layers(config)
    if sliding:
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern(sliding)
        writer.add_rope_freq_base_swa(float(rope.get("sliding_attention", full)["rope_theta"]))
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    writer.add_vocab_size(config.vocab_size)
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer.add_file_type(file_types[kind])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def export_gguf(directory: str | Path, output: str | Path, kind: str = "f16", force: bool = False,
                name: str | None = None, vocabulary_from: Path | None = None) -> dict:
    """Write ``output`` (a ``.gguf`` file) from the HF output directory ``directory``; returns a summary
    ``{"file", "type", "architecture", "tensors", "bytes"}``; ``name`` is ``general.name`` (default: the
    directory's name; note transformers reads a name containing "mistral" as a Mistral model);
    ``vocabulary_from``: the source GGUF whose vocabulary to write (default: the one ``report.json`` records).

    Before a byte is written (``recipe_engine.io.output.check_file_output``): the output is not a directory (not even
    with ``force``), not an existing file without ``force``, its directory is writable and has room for the
    file (tensor sizes from the safetensors headers). The output's lock (``output_lock``) is held while
    writing; temporaries of a killed export of the same file are removed. Atomic: a temporary sibling
    renamed into place."""
    directory = Path(directory).expanduser()
    if kind not in TYPES:
        raise _fail(f"--type {kind!r} is not one of {', '.join(TYPES)}")
    if not (directory / "config.json").is_file():
        raise _fail(f"'{directory}' is not a model directory (no config.json)")
    output = check_file_output(output, force, inputs=[directory])
    with output_lock(output):  # checked again under the lock: another export may have written it meanwhile
        return _export(directory, check_file_output(output, force, inputs=[directory]), kind, name, vocabulary_from)


def _export(directory: Path, output: Path, kind: str, name: str | None, origin: Path | None) -> dict:
    from transformers import AutoConfig  # deferred: transformers' model classes take seconds to import

    config = AutoConfig.from_pretrained(directory)
    check_exportable(directory, config)
    check_checkpoint(directory, config)  # a GGUF must hold every block its metadata counts
    adapter = gguf_adapter(config)
    arch_name = adapter.gguf.arch
    plan = _tensor_plan(directory, config, kind, adapter)
    vocab = vocabulary(directory, config.vocab_size, origin)
    check_free_bytes(output, planned_bytes(plan, vocab.tokens), f"the {kind} GGUF file")
    _remove_stale_temporaries(output)
    temporary = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    track(temporary)
    try:
        writer = gguf.GGUFWriter(str(temporary), arch_name)
        _metadata(writer, config, kind, name or directory.resolve().name)
        vocab.write(writer, directory)
        for gguf_name, _, _, shape, qtype, _ in plan:
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
                writer.add_tensor_info(gguf_name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
            else:
                byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
                writer.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, hf_name, file, _, qtype, role in plan:
            with safe_open(file, "pt") as f:
                tensor = f.get_tensor(hf_name)
            writer.write_tensor_data(_encoding(gguf_tensor(tensor, role, adapter, config), qtype))
        writer.close()
        os.replace(temporary, output)
    except OSError as exc:  # a disk that filled up after the check, a file system that went read-only
        temporary.unlink(missing_ok=True)
        raise _fail(f"writing '{output}' failed: {exc.strerror or exc}; nothing written", "output") from None
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    finally:
        untrack(temporary)
    return {"file": str(output), "type": kind, "architecture": arch_name, "tensors": len(plan),
            "bytes": output.stat().st_size}


def planned_bytes(plan, tokens: list[str]) -> int:
    """The GGUF file's size from the tensor plan (each tensor in its GGML type: ``GGML_QUANT_SIZES`` gives
    the block length and bytes per block) plus the vocabulary's strings; the other metadata is small."""
    size = 0
    for _, _, _, shape, qtype, _ in plan:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        size += int(np.prod(shape)) // block * block_bytes
    return size + sum(len(token.encode("utf-8")) + 16 for token in tokens)


def _remove_stale_temporaries(output: Path) -> None:
    """``.NAME.tmp-PID`` files beside the output were left by a killed export: the lock we hold says no live
    export of this file is writing one."""
    for path in output.parent.glob(f".{output.name}.tmp-*"):
        if path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            print(f"note: removed {path}, left by an interrupted export", file=sys.stderr)
