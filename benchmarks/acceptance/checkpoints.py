"""What several legs share: the tiny random checkpoint (``--tiny``, and the offload leg on any device), the small
FlattenGPT recipe of the dp and offload legs, and the bit-for-bit comparison of their outputs."""
from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=49152, tie_word_embeddings=False)
TINY_LAYERS = 8


def load_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def tiny_checkpoint(work: Path, tokenizer: str = "smollm2-135m") -> Path:
    """A tiny random Llama (``TINY_SHAPE``) with ``tokenizer``'s files (an alias, or the carried directory)."""
    import torch

    from benchmarks import scale

    return scale.write_synthetic(work / "tiny-llama", TINY_LAYERS, torch.float32, tokenizer=tokenizer, **TINY_SHAPE)


def small_flatten_recipe(args, work: Path, tiny: bool = False) -> dict:
    """recipes/flatten20_smollm2.yaml on 8 × 256 tokens (``--tiny`` or ``tiny``: a tiny checkpoint, 4 × 64,
    2 merges)."""
    recipe = load_yaml(ROOT / "recipes" / "flatten20_smollm2.yaml")
    recipe.update(device=args.device, evaluate=None)
    recipe["calibration"].update(samples=8, seq_len=256)
    if args.tiny or tiny:
        recipe["model"] = str(tiny_checkpoint(work, args.tokenizer))
        recipe["calibration"].update(samples=4, seq_len=64, batch_size=2)
        recipe["modifiers"][1]["FlattenAdjacent"]["n"] = 2
    return recipe


def identical_outputs(work: Path, names: tuple[str, ...]) -> list[bool]:
    """For each output after the first: its tensors are the first's, bit for bit (then every output is
    removed)."""
    from safetensors.torch import load_file

    first, *others = (load_file(str(work / name / "model.safetensors")) for name in names)
    identical = [first.keys() == other.keys() and all(
        first[k].dtype == other[k].dtype and bool((first[k] == other[k]).all()) for k in first) for other in others]
    for name in names:
        shutil.rmtree(work / name, ignore_errors=True)
    return identical
