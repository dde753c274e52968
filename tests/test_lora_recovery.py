"""LoRARecovery: loss goes down in a few CPU steps, adapters merge into a stock checkpoint, distillation."""
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import recipe_engine
from recipe_engine.modifiers.lora_recovery import alpaca_prompt, training_examples
from recipe_engine.numerics.ops import top_k_kl
from tests.helpers import CharTokenizer, tiny_model

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "piano", "lemon"]


def alpaca_file(tmp_path):
    records = [{"instruction": f"Repeat the word {w} three times.", "input": "" if i % 2 else "please",
                "output": f"{w} {w} {w}"} for i, w in enumerate(WORDS)]
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(records))
    return path, records


def recipe(tmp_path, steps):
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(WORDS * 40))
    return dict(version=1, name="lora-test", model="tiny", device="cpu", output=str(tmp_path / "out"),
                calibration=dict(dataset=str(text), samples=2, seq_len=32, batch_size=2), modifiers=steps)


@torch.no_grad()
def response_nll(model, records, tokenizer):
    """Mean NLL of the response tokens given the Alpaca prompt, computed directly with the model."""
    total, count = 0.0, 0
    for record in records:
        prompt = tokenizer(alpaca_prompt(record))["input_ids"]
        answer = tokenizer(record["output"])["input_ids"]
        ids = torch.tensor([prompt + answer])
        logits = model(ids).logits[0, len(prompt) - 1:-1]
        total += float(F.cross_entropy(logits, ids[0, len(prompt):], reduction="sum"))
        count += len(answer)
    return total / count


def test_alpaca_examples_mask_the_prompt(tmp_path):
    path, records = alpaca_file(tmp_path)
    examples, kind = training_examples(CharTokenizer(), str(path), "train", "text", 512, None)
    assert kind == "alpaca" and len(examples) == len(records)
    for example in examples:
        answer = [t for t in example["labels"] if t != -100]
        record = next(r for r in records if CharTokenizer()(r["output"])["input_ids"] == answer)
        prompt = CharTokenizer()(alpaca_prompt(record))["input_ids"]
        assert example["input_ids"] == prompt + answer
        assert example["labels"] == [-100] * len(prompt) + answer


def test_top_k_kl_equals_full_kl_when_k_is_the_vocabulary():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 1, 1, 1]], dtype=torch.float32)
    full = F.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    expected = (full * mask).sum() / mask.sum()
    for over in ("vocabulary", "top_k"):  # k = vocabulary: both normalisations are the full KL
        torch.testing.assert_close(top_k_kl(student, teacher, mask, 11, over), expected)
        assert top_k_kl(student, teacher, mask, 3, over) >= 0


def test_top_k_kl_student_over_top_k_is_kl_of_both_renormalised():
    """``top_k``: KL between the teacher's and the student's softmax over the teacher's top-k (LinearPatch
    Eq. 9), by torch's kl_div on explicitly gathered logits; ``vocabulary`` differs when k < vocabulary."""
    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 1, 1, 1]], dtype=torch.bool)
    top, index = teacher.topk(4, -1)
    kl = F.kl_div(student.gather(-1, index).log_softmax(-1), top.log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)
    torch.testing.assert_close(top_k_kl(student, teacher, mask, 4, "top_k"), kl[mask].mean())
    assert float(top_k_kl(student, teacher, mask, 4, "vocabulary")) != pytest.approx(float(kl[mask].mean()))


def test_lora_recovery_lowers_loss_and_merges_to_stock_checkpoint(tmp_path, capfd):
    path, records = alpaca_file(tmp_path)
    model, tokenizer = tiny_model(), CharTokenizer()
    before = response_nll(model, records, tokenizer)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = {"LoRARecovery": {"r": 8, "alpha": 16, "lr": 1e-2, "max_steps": 8, "batch_size": 4,
                             "micro_batch_size": 4, "seq_len": 256, "dataset": str(path), "save_adapter": True}}
    out, report = recipe_engine.apply(recipe(tmp_path, [step]), model=model, tokenizer=tokenizer, progress=False)
    written = capfd.readouterr()
    # the trainer's steps go to the run's progress display (disabled here): transformers' own PrinterCallback
    # would print a dict per step on standard output
    assert "'loss'" not in written.out + written.err and "train_runtime" not in written.out + written.err
    result = report.steps[0].result
    assert result["steps"] == 8 and len(result["loss_history"]) == 8 and result["format"] == "alpaca"
    after = response_nll(out, records, tokenizer)
    assert after < before - 0.1, (before, after)  # random init: about ln(128) = 4.85 nats
    assert result["loss_last"] < result["loss_first"]
    directory = tmp_path / "out"
    assert (directory / "lora_recovery_loss.png").read_bytes().startswith(b"\x89PNG")
    assert json.loads((directory / "lora_adapter" / "adapter_config.json").read_text())["r"] == 8
    loaded = AutoModelForCausalLM.from_pretrained(directory)
    names = [n for n, _ in loaded.named_parameters()]
    assert names == list(original) and not any("lora" in n for n in names)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(loaded.get_parameter(q_proj), original[q_proj])
    assert torch.equal(loaded.model.embed_tokens.weight, original["model.embed_tokens.weight"])
    ids = torch.tensor([tokenizer("### Response:\napple")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, out(ids).logits)


@torch.no_grad()
def kl_to(teacher, student, ids):
    """Full-vocabulary KL(teacher ‖ student) per token."""
    t, s = teacher(ids).logits.log_softmax(-1), student(ids).logits.log_softmax(-1)
    return float(F.kl_div(s, t, log_target=True, reduction="none").sum(-1).mean())


def peaked_model():
    """Tiny model with a 8× lm_head, so its next-token distributions are far from uniform."""
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


def test_distill_moves_the_compressed_model_toward_the_dense_teacher(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text(" ".join(WORDS * 60))
    quantize = {"Quantize": {"bits": 2, "group_size": 32, "export": "dequantized"}}
    quantized, _ = recipe_engine.apply(recipe(tmp_path, [quantize]), model=peaked_model(),
                                       tokenizer=CharTokenizer(), write=False, progress=False)
    lora = {"LoRARecovery": {"lr": 5e-3, "max_steps": 6, "batch_size": 4, "micro_batch_size": 4, "seq_len": 64,
                             "dataset": str(text), "distill": True, "top_k": 16}}
    recovered, report = recipe_engine.apply(recipe(tmp_path, [quantize, lora]), model=peaked_model(),
                                            tokenizer=CharTokenizer(), write=False, progress=False)
    assert report.steps[1].result["format"] == "text"
    ids = torch.tensor([CharTokenizer()(" ".join(WORDS * 2))["input_ids"][:64]])
    dense = peaked_model()
    assert kl_to(dense, recovered, ids) < 0.6 * kl_to(dense, quantized, ids)


def test_distill_from_a_model_directory_loads_the_dense_teacher(tmp_path):
    """From a checkpoint directory the original model is a skeleton read from its files: distillation loads
    it whole as the teacher, and the result is the in-memory run's (same teacher logits, same training)."""
    from tests.helpers import byte_tokenizer, save_tiny_model

    text = tmp_path / "train.txt"
    text.write_text(" ".join(WORDS * 60))
    source = tmp_path / "dense"
    dense = save_tiny_model(source)
    steps = [{"ShortGPT": {"n": 1}},
             {"LoRARecovery": {"lr": 5e-3, "max_steps": 2, "batch_size": 2, "micro_batch_size": 2, "seq_len": 32,
                               "dataset": str(text), "distill": True, "top_k": 8}}]
    from_files, report = recipe_engine.apply({**recipe(tmp_path, steps), "model": str(source)}, write=False,
                                             progress=False)
    assert report.steps[1].result["distill"] is True
    in_memory, _ = recipe_engine.apply(recipe(tmp_path, steps), model=dense, tokenizer=byte_tokenizer(),
                                       write=False, progress=False)
    for (name, a), b in zip(from_files.state_dict().items(), in_memory.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_batch_must_be_a_multiple_of_the_micro_batch():
    from recipe_engine.modifiers.lora_recovery import LoRARecovery

    with pytest.raises(ValueError, match="not a multiple of micro_batch_size"):
        LoRARecovery(batch_size=6, micro_batch_size=4)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3", "qwen3_moe"])
def test_training_memory_estimate_covers_what_autograd_saves(model_type):
    """``recipe plan``'s working memory for the training step is at least the tensors autograd saves in one
    micro-batch's forward of the adapted model (counted by ``saved_tensors_hooks``, each storage once) and at
    most twice them; without it the plan had counted only the weights (a measured run peaked 3.4x over)."""
    from peft import LoraConfig, get_peft_model

    from recipe_engine.architectures.adapters import adapter_for
    from recipe_engine.architectures.shape import ModelShape
    from recipe_engine.modifiers.lora_recovery import LoRARecovery

    step = LoRARecovery(micro_batch_size=2, batch_size=4, seq_len=48, r=8)
    model = tiny_model(model_type).train()
    estimate = step.working_memory(ModelShape.from_config(model.config), tokens=0)
    adapter = adapter_for(model.config)
    modules = [adapter.path(role).rsplit(".", 1)[-1] for role in adapter.module_roles(step.projections(model_type))]
    adapted = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=modules, task_type="CAUSAL_LM"))
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    storages: dict[int, int] = {}

    def count(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        adapted(input_ids=ids, labels=ids).loss.backward()
    saved = sum(storages.values())
    assert saved <= estimate <= 2 * saved, (estimate, saved)
