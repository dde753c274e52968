"""GGUF export of a finished output directory, for llama.cpp / Ollama / LM Studio.

Reads only the directory (``config.json``, safetensors weights, ``tokenizer.json`` and its config), and
writes one GGUF file with the ``gguf`` package's writer: architecture metadata, the byte-level BPE tokenizer
(tokens with their types, merges, special token ids, chat template) and the weights under llama.cpp's tensor
names (``gguf.get_tensor_name_map``). Tensors are streamed: tensor infos first (sizes from the shapes),
then the data one tensor at a time, into a temporary sibling renamed into place.

Conventions followed (llama.cpp's ``convert_hf_to_gguf.py``, read, not copied): 1-D tensors (norms, biases)
stay F32 whatever ``--type``; Llama/Mistral q/k rows are reordered from HF's rotate-half layout to GGML's
adjacent-pair rope (``permute_rope``); a tied ``lm_head`` is not written (llama.cpp and transformers reuse
``token_embd``). Refused in one line: anything GGUF or llama.cpp's graph cannot express for these
architectures — recipe extras (LinearPatch), compressed-tensors packed weights, non-uniform layers, rope
scaling, sliding windows, unknown pre-tokenizers.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from ..errors import RecipeError
from ..system.cleanup import track, untrack
from .checkpoint_reader import INDEX_FILE, SINGLE_FILE
from .extras import EXTRAS_JSON
from .output import check_file_output, check_free_bytes
from .output_lock import output_lock

TYPES = ("f32", "f16", "bf16", "q8_0")
#: HF model_type → llama.cpp architecture (Mistral without sliding window is llama.cpp's llama graph).
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
#: tokenizer.json pre-tokenizer → llama.cpp ``tokenizer.ggml.pre`` (the regex llama.cpp applies before BPE).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _fail(message: str) -> RecipeError:
    return RecipeError(f"GGUF export: {message}", field="output")


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
    raise _fail(f"pre-tokenizer {json.dumps(pre)[:120]} is not one llama.cpp names here (known: gpt-2, qwen2)")


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


def check_config(config) -> None:
    """Architectures and attention variants this export writes (and llama.cpp's graphs compute)."""
    if config.model_type not in ARCHITECTURES:
        raise _fail(f"model_type {config.model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise _fail(f"rope scaling {rope.get('rope_type')!r} is not exported (needs llama.cpp's rope_freqs)")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise _fail("sliding-window attention is not exported (llama.cpp's llama/qwen2 graphs attend fully)")
    if getattr(config, "mlp_bias", False):
        raise _fail("MLP biases are not exported (llama.cpp's llama graph has none)")


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    from transformers import AutoModelForCausalLM  # deferred: transformers' model classes take seconds to import

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _encoding(tensor: torch.Tensor, qtype) -> np.ndarray:
    """The tensor as the bytes of GGML type ``qtype`` (F32, F16, or BF16/Q8_0 via ``gguf.quants``)."""
    data = tensor.to(torch.float32).contiguous().numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return data
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def _tensor_plan(directory: Path, config, kind: str, arch) -> list[tuple[str, str, str, tuple[int, ...], object]]:
    """``(gguf name, hf name, file, shape, GGML type)`` per tensor, in file order; refuses unknown names,
    shapes that differ from the config (non-uniform layers) and rows Q8_0 cannot block."""
    files = _weights(directory)
    expected = _expected_shapes(config)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    plan, shapes = [], {}
    for file in dict.fromkeys(files.values()):
        with safe_open(file, "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    for hf_name in files:
        shape = shapes[hf_name]
        if hf_name not in expected:
            raise _fail(f"tensor {hf_name} is not part of a stock {config.model_type} model")
        if shape != expected[hf_name]:
            raise _fail(f"{hf_name} has shape {list(shape)} but the config implies {list(expected[hf_name])}: "
                        f"non-uniform layers (this export writes one head count and FFN width per model)")
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise _fail(f"no llama.cpp name for tensor {hf_name}")
        if len(shape) == 1 or kind == "f32":
            qtype = gguf.GGMLQuantizationType.F32
        else:
            qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
                     "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            if shape[-1] % block:
                raise _fail(f"{hf_name}: row length {shape[-1]} is not a multiple of {kind}'s block {block}")
        plan.append((gguf_name, hf_name, files[hf_name], shape, qtype))
    return sorted(plan, key=lambda row: _order(row[0]))


def _order(gguf_name: str) -> tuple[int, str]:
    """llama.cpp's usual file order: token_embd, blocks in index order, output_norm, output."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return 1 + int(parts[1]), gguf_name
    return (0 if parts[0] == "token_embd" else 10**9), gguf_name


def _vocabulary(directory: Path, vocab_size: int) -> tuple[list[str], list[int], str]:
    """Tokens by id (``[PAD{i}]`` for ids the tokenizer lacks up to the config's vocabulary), their llama.cpp
    types (special added tokens CONTROL, other added tokens USER_DEFINED, ids without a token UNUSED) and
    the pre-tokenizer name. Only byte-level BPE (``tokenizer.ggml.model: gpt2``) is exported."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise _fail(f"'{directory}' has no tokenizer.json (a byte-level BPE tokenizer is required)")
    data = json.loads(path.read_text(encoding="utf-8"))
    model, decoder = data.get("model") or {}, data.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise _fail("only byte-level BPE tokenizers are exported (llama.cpp 'gpt2' vocabulary); "
                    f"this one is {model.get('type')} with a {decoder.get('type')} decoder")
    if not model.get("merges"):
        raise _fail("the BPE tokenizer has no merges; llama.cpp refuses a BPE vocabulary without them")
    pre = pre_tokenizer_name(data)
    by_id = {i: t for t, i in model["vocab"].items()}
    kinds = {}
    for added in data.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        kinds[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    if max(by_id) >= vocab_size:
        raise _fail(f"tokenizer has id {max(by_id)} but the model's vocabulary is {vocab_size}")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [int(kinds.get(i, gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED))
             for i in range(vocab_size)]
    return tokens, types, pre


def _metadata(writer, config, arch_name: str, kind: str, name: str) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer.add_file_type(file_types[kind])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def export_gguf(directory: str | Path, output: str | Path, kind: str = "f16", force: bool = False,
                name: str | None = None) -> dict:
    """Write ``output`` (a ``.gguf`` file) from the HF output directory ``directory``; returns a summary
    ``{"file", "type", "architecture", "tensors", "bytes"}``; ``name`` is ``general.name`` (default: the
    directory's name; note transformers reads a name containing "mistral" as a Mistral model).

    Before a byte is written (``preflight.check_file_output``): the output is not a directory (not even
    with ``force``), not an existing file without ``force``, its directory is writable and has room for the
    file (tensor sizes from the safetensors headers). The output's lock (``output_lock``) is held while
    writing; temporaries of a killed export of the same file are removed. Atomic: a temporary sibling
    renamed into place."""
    directory = Path(directory).expanduser()
    if kind not in TYPES:
        raise _fail(f"--type {kind!r} is not one of {', '.join(TYPES)}")
    if not (directory / "config.json").is_file():
        raise _fail(f"'{directory}' is not a model directory (no config.json)")
    output = check_file_output(output, force)
    with output_lock(output):  # checked again under the lock: another export may have written it meanwhile
        return _export(directory, check_file_output(output, force), kind, name)


def _export(directory: Path, output: Path, kind: str, name: str | None) -> dict:
    from transformers import AutoConfig  # deferred: transformers' model classes take seconds to import

    config = AutoConfig.from_pretrained(directory)
    check_exportable(directory, config)
    arch_name = ARCHITECTURES[config.model_type]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    plan = _tensor_plan(directory, config, kind, arch)
    tokens, types, pre = _vocabulary(directory, config.vocab_size)
    check_free_bytes(output, planned_bytes(plan, tokens), f"the {kind} GGUF file")
    _remove_stale_temporaries(output)
    temporary = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    track(temporary)
    try:
        writer = gguf.GGUFWriter(str(temporary), arch_name)
        _metadata(writer, config, arch_name, kind, name or directory.resolve().name)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        gguf.SpecialVocab(directory, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
        for gguf_name, _, _, shape, qtype in plan:
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
                writer.add_tensor_info(gguf_name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
            else:
                byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
                writer.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
        for gguf_name, hf_name, file, _, qtype in plan:
            with safe_open(file, "pt") as f:
                tensor = f.get_tensor(hf_name)
            if arch_name == "llama" and gguf_name.split(".")[-2] in ("attn_q", "attn_k"):
                tensor = permute_rope(tensor, heads if gguf_name.split(".")[-2] == "attn_q" else kv_heads or heads)
            writer.write_tensor_data(_encoding(tensor, qtype))
        writer.close()
        os.replace(temporary, output)
    except OSError as exc:  # a disk that filled up after the check, a file system that went read-only
        temporary.unlink(missing_ok=True)
        raise _fail(f"writing '{output}' failed: {exc.strerror or exc}; nothing written") from None
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
    for _, _, _, shape, qtype in plan:
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
