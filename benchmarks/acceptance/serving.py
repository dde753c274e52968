"""The checkpoints the bench and w4 legs time, built by those legs themselves: serving speed depends on shapes,
not on weights, so neither leg waits for the stream8b leg's recipe (minutes) or needs it in the same call.

  dense   Llama-3-8B-shaped, 32 layers, bf16 (``benchmarks/scale.py``'s writer; random weights drawn on the device)
  cut     the same shapes with 25 layers, bf16: the size of FlattenGPT's 32 → 25 output, the layer cut alone
  packed  ``cut`` with every decoder linear on the symmetric 4-bit grid of groups of 128 (round to nearest; GPTQ's
          default grid, whose codes these are as far as a kernel can tell), packed by the engine's own
          compressed-tensors exporter (``pack-quantized``, what ``GPTQ<bits:4>`` writes by default) and its
          ``quantization_config``; embeddings, norms and the head stay bf16, as GPTQ leaves them

``--tiny``: the tiny random Llama's shapes, 8 and 6 layers, groups of 32. Written once into ``serving/`` beside the
legs' work directories (a later call with the same --work finds them), each into a ``.partial`` directory renamed
into place.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from benchmarks.acceptance.checkpoints import TINY_LAYERS, TINY_SHAPE

DENSE_LAYERS, CUT_LAYERS = 32, 25      # Llama-3-8B, and FlattenGPT's 7 merges (the stream8b recipe's output)
GROUP_SIZE = 128                       # GPTQ<bits:4>'s default groups


def serving_checkpoints(args, work: Path) -> dict:
    """``{"dense", "cut", "packed": path, "layers": [dense, cut]}``, written under ``work.parent / "serving"`` unless
    already there."""
    import torch

    from benchmarks import scale

    shape, layers, group = (TINY_SHAPE, (TINY_LAYERS, TINY_LAYERS - 2), 32) if args.tiny else (
        scale.LLAMA3_8B, (DENSE_LAYERS, CUT_LAYERS), GROUP_SIZE)
    root = work.parent / "serving"
    written = {name: scale.write_synthetic(root / f"{name}-{count}-bf16", count, torch.bfloat16, device=args.device,
                                           tokenizer=args.tokenizer, **shape)
               for name, count in zip(("dense", "cut"), layers)}
    packed = packed_copy(written["cut"], root / f"cut-{layers[1]}-w4g{group}", group, args.device)
    return {"dense": str(written["dense"]), "cut": str(written["cut"]), "packed": str(packed), "layers": list(layers)}


def is_decoder_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def packed_copy(source: Path, target: Path, group_size: int, device: str = "cpu") -> Path:
    """``source`` (bf16, sharded) with its decoder linears rounded to the symmetric W4 grid of ``group_size`` and
    packed as compressed-tensors ``pack-quantized`` (shard by shard: one shard's tensors held at a time)."""
    import torch
    from safetensors.torch import load_file, save_file

    from recipe_engine.formats.compressed_tensors import CompressedTensors
    from recipe_engine.numerics.quantization import Grid, QuantizedLinear

    if (target / "config.json").is_file():
        return target
    exporter, grid = CompressedTensors(), Grid(4, group_size, True, torch.bfloat16)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json",
                                                                   "config.json"))
    index = json.loads((source / "model.safetensors.index.json").read_text())
    weight_map, grids, total = {}, {}, 0
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, weight in load_file(str(source / shard)).items():
            if not is_decoder_linear(name):
                tensors[name] = weight
                continue
            weight = weight.to(device)
            rows, columns = weight.shape
            groups = weight.float().view(rows, columns // group_size, group_size)
            scale, zero = grid.params(groups)
            record = QuantizedLinear(grid, scale, zero.to(torch.int16))
            rounded = grid.fake(groups, scale[..., None], zero[..., None])
            linear = name.removesuffix(".weight")
            packed = exporter.pack(linear, rounded.view(rows, columns).to(torch.bfloat16), record)
            tensors.update({f"{linear}.{key}": value.cpu() for key, value in packed.items()})
            grids[linear] = grid
        save_file(tensors, str(partial / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (partial / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = exporter.quantization_config(grids, ignore=["lm_head"])
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(partial, target)
    return target
