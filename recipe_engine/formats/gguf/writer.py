"""GGUF export of a finished output directory, for llama.cpp / Ollama / LM Studio.

Reads the directory (``config.json``, safetensors weights, the tokenizer) and, for a model converted from a
GGUF file, that file's metadata, and writes one GGUF file with the ``gguf`` package's writer: architecture
metadata, the vocabulary (``gguf_vocabulary``) and the weights under llama.cpp's tensor names. Tensors are
streamed: tensor infos first (sizes from the shapes), then the data one tensor at a time, into a temporary sibling
renamed into place.
A packed checkpoint (``recipe_engine.formats``) is read through ``CheckpointReader``, which dequantizes
each packed linear into the checkpoint's dtype as it is read.

Every architecture fact comes from the model's layout (``layout.LAYOUTS``: llama.cpp's architecture
name, the tensor name of each role, rope row order, sliding windows, soft-capping, activation, further
config checks); this module names no architecture. Conventions followed (llama.cpp's
``convert_hf_to_gguf.py``, read, not copied): 1-D tensors (norms, biases) stay F32 whatever ``--type``;
q/k rows are reordered from HF's rotate-half layout to GGML's adjacent-pair rope where the graph rotates pairs
(``permute_rope``); norms stored as ``w`` with gain ``offset + w`` (Gemma's ``1 + w``) are written as the gain;
a tied ``lm_head`` is not written (llama.cpp and transformers reuse ``token_embd``); a mixture-of-experts
layer's experts are read stacked (``CheckpointReader`` with the model: per-expert tensors, packed or not) and
written as ``ffn_{gate,up,down}_exps`` ``[experts, rows, columns]``, gate and up apart, with the router as
``ffn_gate_inp`` and the ``expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length`` keys. Refused in
one line:
anything GGUF or the architecture's llama.cpp graph cannot express — recipe extras (LinearPatch),
tensors that disagree with the config (missing, extra, of another shape:
non-uniform layers), rope scaling, sliding windows where the graph attends fully, unknown tokenizers.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from ...architectures.adapters import ADAPTERS, ArchitectureAdapter, adapter_for
from ...checkpoint.reader import CheckpointReader, check_checkpoint, in_memory_shapes, meta_model
from ...errors import RecipeError, reading
from ...paths.lock import output_lock
from ...paths.output import check_file_output, check_free_bytes
from ...records.extras import EXTRAS_JSON
from ...system.cleanup import track, untrack
from .. import Exporter, register
from .layout import GGUF_MOE_KEYS, LAYOUTS, gguf_tensors
from .vocabulary import check_source_vocabulary, vocabulary

TYPES = ("f32", "f16", "bf16", "q8_0")


def _fail(message: str, field: str | None = None) -> RecipeError:
    return RecipeError(f"GGUF export: {message}", field=field)


def permute_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotate-half rows ``[x_0..x_{d/2-1}, y_0..y_{d/2-1}]`` per head → GGML's ``[x_0, y_0, x_1, y_1, ...]``
    (llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` rotates adjacent pairs)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def check_recipe_exportable(steps, shapes, config) -> None:
    """Before anything loads: ``recipe.export`` refused for steps whose output GGUF cannot hold (each step
    asked on the shape it receives: non-stock extras) and for an unsupported model config. Packed
    quantized weights are dequantized as they are exported."""
    for index, (step, shape) in enumerate(zip(steps, shapes)):
        if not step.output_is_stock(shape):
            raise _fail(f"step {index} ({step.step_name()}) adds non-stock extras that GGUF cannot express")
    check_config(config)


def check_exportable(directory: Path, config) -> None:
    """The one-line refusals that need only the directory's files (weights are checked while written)."""
    if (directory / EXTRAS_JSON).is_file():
        names = ", ".join(e["modifier"] for e in json.loads((directory / EXTRAS_JSON).read_text()))
        raise _fail(f"the checkpoint carries recipe extras ({names}) that GGUF cannot express; export a "
                    f"recipe without them (with export: {{format: gguf}} a BestOf recipe chooses among the "
                    f"alternatives GGUF can hold)")
    check_config(config)


def gguf_adapter(config) -> ArchitectureAdapter:
    """The adapter of ``config.model_type`` if it has GGUF facts; anything else is one line."""
    adapter = ADAPTERS.get(getattr(config, "model_type", None))
    if adapter is None or adapter.model_type not in LAYOUTS:
        supported = ", ".join(t for t in ADAPTERS if t in LAYOUTS)
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
    layout = LAYOUTS[gguf_adapter(config).model_type]
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


#: The halves of an MoE layer's stacked ``gate_up_proj`` (gate rows first) that llama.cpp stores apart.
EXPERT_HALVES = {"gate_exps": 0, "up_exps": 1}


def _tensor_plan(directory: Path, config, kind: str, adapter,
                 model=None) -> list[tuple[str, str, tuple[int, ...], object, str]]:
    """``(gguf name, hf name, shape, GGML type, role)`` per GGUF tensor, in file order (the tensors agree with
    the config: ``check_checkpoint``; named as ``model``, the config's model on the meta device, holds them: a
    packed linear as its ``weight``, per-expert tensors stacked, an MoE layer's ``gate_up_proj`` giving its gate
    and up halves); refuses tensors llama.cpp has no name for and rows Q8_0 cannot block."""
    names = gguf_tensors(adapter, config.num_hidden_layers)
    plan = []
    for hf_name, stored in in_memory_shapes(directory, model if model is not None else meta_model(config)).items():
        if hf_name not in names:
            raise _fail(f"no llama.cpp name for tensor {hf_name}")
        for gguf_name, role in names[hf_name]:
            shape = _gguf_shape(stored, role)
            if len(shape) == 1 or kind == "f32":
                qtype = gguf.GGMLQuantizationType.F32
            else:
                qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
                         "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
                block = gguf.GGML_QUANT_SIZES[qtype][0]
                if shape[-1] % block:
                    raise _fail(f"{hf_name}: row length {shape[-1]} is not a multiple of {kind}'s block {block}")
            plan.append((gguf_name, hf_name, shape, qtype, role))
    return sorted(plan, key=lambda row: _order(row[0]))


def _gguf_shape(shape: tuple[int, ...], role: str) -> tuple[int, ...]:
    """The shape :func:`gguf_tensor` gives a tensor of ``shape``."""
    if role in EXPERT_HALVES:
        return (shape[0], shape[1] // 2, *shape[2:])
    return (shape[-1],) if role == "shared_gate" else shape


def gguf_tensor(tensor: torch.Tensor, role: str, adapter, config) -> torch.Tensor:
    """An HF tensor as llama.cpp reads it: q/k rows in adjacent-pair rope order where the graph rotates pairs,
    a norm's weight ``w`` as its gain ``norm_offset + w`` (fp32), the gate or up half of stacked experts, a
    shared expert's gate ``Linear(hidden, 1)`` as its vector."""
    if LAYOUTS[adapter.model_type].rope_adjacent_pairs and role in ("q_proj", "k_proj"):
        heads = config.num_attention_heads
        return permute_rope(tensor,
                            heads if role == "q_proj" else getattr(config, "num_key_value_heads", None) or heads)
    if adapter.norm_offset and (role in adapter.norms or role == "final_norm"):
        return tensor.float() + adapter.norm_offset
    if role in EXPERT_HALVES:
        return tensor.chunk(2, dim=1)[EXPERT_HALVES[role]]
    return tensor.reshape(-1) if role == "shared_gate" else tensor


def _order(gguf_name: str) -> tuple[int, str]:
    """llama.cpp's usual file order: token_embd, blocks in index order, output_norm, output."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return 1 + int(parts[1]), gguf_name
    return (0 if parts[0] == "token_embd" else 10**9), gguf_name


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
    for size, value in gguf_adapter(config).moe_sizes(config).items():  # none on a dense architecture
        getattr(writer, GGUF_MOE_KEYS[size])(value)
    writer.add_vocab_size(config.vocab_size)
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer.add_file_type(file_types[kind])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def export_gguf(directory: str | Path, output: str | Path, kind: str = "f16", force: bool = False,
                name: str | None = None, progress=None, vocabulary_from: Path | None = None) -> dict:
    """Write ``output`` (a ``.gguf`` file) from the HF output directory ``directory``; returns a summary
    ``{"file", "type", "architecture", "tensors", "bytes"}``; ``name`` is ``general.name`` (default: the
    directory's name; note transformers reads a name containing "mistral" as a Mistral model); ``progress``: a
    ``system.progress.Progress`` that tracks the tensors written; ``vocabulary_from``: the source GGUF whose
    vocabulary to write (default: the one ``report.json`` records).

    Before a byte is written (``recipe_engine.paths.output.check_file_output``): the output is not a directory (not even
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
        return _export(directory, check_file_output(output, force, inputs=[directory]), kind, name, vocabulary_from,
                       progress)


def _export(directory: Path, output: Path, kind: str, name: str | None, origin: Path | None,
            progress=None) -> dict:
    from transformers import AutoConfig  # deferred: transformers' model classes take seconds to import

    with reading(f"{directory / 'config.json'}"):  # sizes transformers itself rejects: one line
        config = AutoConfig.from_pretrained(directory)
    check_exportable(directory, config)
    check_checkpoint(directory, config)  # a GGUF must hold every block its metadata counts
    adapter = gguf_adapter(config)
    arch_name = LAYOUTS[adapter.model_type].arch
    model = meta_model(config)
    plan = _tensor_plan(directory, config, kind, adapter, model)
    vocab = vocabulary(directory, config.vocab_size, origin)
    check_free_bytes(output, planned_bytes(plan, vocab.tokens), f"the {kind} GGUF file")
    _remove_stale_temporaries(output)
    temporary = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    track(temporary)
    try:
        writer = gguf.GGUFWriter(str(temporary), arch_name)
        _metadata(writer, config, kind, name or directory.resolve().name)
        vocab.write(writer, directory)
        for gguf_name, _, shape, qtype, _ in plan:
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
                writer.add_tensor_info(gguf_name, shape, np.dtype(dtype),
                                       int(np.prod(shape)) * np.dtype(dtype).itemsize)
            else:
                byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
                writer.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        tensors = plan if progress is None else progress.track(plan, "GGUF tensors written")
        reader = CheckpointReader(directory, model)  # in-memory names: per-expert tensors stacked
        for _, hf_name, _, qtype, role in tensors:
            tensor = reader.read([hf_name])[hf_name]
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
    for _, _, shape, qtype, _ in plan:
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


@register
class GGUF(Exporter):
    """The file format ``gguf``: what the pre-flight, the run and the card ask of it."""

    name = "gguf"
    summary = "one file for llama.cpp, Ollama, LM Studio (f32, f16, bf16, q8_0)"
    types = ("f16", "f32", "bf16", "q8_0")  # the first is the default; TYPES in another order
    default_file = "model.gguf"
    reader = "llama.cpp"

    def write_file(self, directory: Path, output: Path, kind: str, *, force: bool = False, name: str | None = None,
                   source=None, progress=None) -> dict:
        origin = getattr(source, "gguf", None)  # the GGUF file the run's weights were converted from
        return export_gguf(directory, output, kind, force=force, name=name, progress=progress,
                           vocabulary_from=Path(origin) if origin else None)

    def check_recipe(self, steps, shapes, config) -> None:
        check_recipe_exportable(steps, shapes, config)

    def check_source(self, spec: str, config) -> None:
        """The tokenizer the run saves is the source's: its vocabulary must be one GGUF can hold."""
        check_source_vocabulary(spec, config.vocab_size)

    def card_line(self, export) -> str:
        return f"`{export.file}`: the same model as one GGUF file ({export.type}) for llama.cpp, Ollama or LM Studio."
