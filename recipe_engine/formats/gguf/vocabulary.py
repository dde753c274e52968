"""llama.cpp's vocabulary (``tokenizer.ggml.*``) for a GGUF export: the source GGUF's own metadata when the
checkpoint was converted from one (a builtin alias, a ``.gguf`` source, or an output of one, as its
``report.json`` records), whatever tokenizer form transformers built from it; otherwise the checkpoint's
``tokenizer.json``: byte-level BPE as llama.cpp's ``gpt2`` vocabulary with its merges, or a SentencePiece-style
BPE with byte fallback as its ``llama`` vocabulary with scores and token types; special token ids and chat
template through ``gguf.SpecialVocab``. Other tokenizers and pre-tokenizers are refused in one line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf

from ...errors import RecipeError
from ...sources.models import hub_file, resolve_model
from .source import gguf_origin, recorded_gguf

#: tokenizer.json pre-tokenizer → llama.cpp ``tokenizer.ggml.pre`` (the regex llama.cpp applies before BPE).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _fail(message: str) -> RecipeError:
    return RecipeError(f"GGUF export: {message}")


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
