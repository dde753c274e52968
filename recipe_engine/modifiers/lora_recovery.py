"""LoRARecovery: a short LoRA fine-tune of the compressed model, merged back into stock weights."""
from __future__ import annotations

import contextlib
import io
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from recipe_engine.api import (ADAPTERS, UNFUSED_ROLES, Modifier, ModifierSession, RecipeError, check_text, load_text,
                               register, roles_problem, tokenize, top_k_kl)

PROJECTIONS = UNFUSED_ROLES  # roles; a fused Phi-3 qkv/gate_up linear gets one adapter when all its members are targets
ADAPTER_DIR = "lora_adapter"
PROMPT = ("Below is an instruction that describes a task{paired}. Write a response that appropriately "
          "completes the request.\n\n### Instruction:\n{instruction}\n\n{context}### Response:\n")


def alpaca_prompt(record: dict[str, str]) -> str:
    """The Stanford Alpaca training prompt (with the ``### Input:`` block only when ``input`` is set)."""
    context = record.get("input") or ""
    paired = ", paired with an input that provides further context" if context else ""
    block = f"### Input:\n{context}\n\n" if context else ""
    return PROMPT.format(paired=paired, instruction=record["instruction"], context=block)


def alpaca_records_file(dataset: str) -> bool:
    """``dataset`` is a local .json/.jsonl file (read as Alpaca records when it holds them)."""
    path = Path(dataset).expanduser()
    return path.is_file() and path.suffix in (".json", ".jsonl")


def alpaca_records(dataset: str) -> list[dict[str, str]] | None:
    """Records of a local .json/.jsonl file in Alpaca format (instruction/input/output), else None."""
    path = Path(dataset).expanduser()
    if not alpaca_records_file(dataset):
        return None
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not (isinstance(records, list) and records and {"instruction", "output"} <= set(records[0])):
        return None
    return records


def alpaca_examples(tokenizer, records: list[dict[str, str]], seq_len: int) -> list[dict[str, list[int]]]:
    """Prompt + response (+ EOS) truncated to ``seq_len``; loss on response tokens only (prompt labels -100)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    end = [eos] if eos is not None else []
    examples = []
    for record in records:
        prompt = tokenizer(alpaca_prompt(record), add_special_tokens=False)["input_ids"]
        answer = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + end
        ids = (prompt + answer)[:seq_len]
        if len(ids) > len(prompt):
            examples.append({"input_ids": ids, "labels": ([-100] * len(prompt) + answer)[:seq_len]})
    return examples


def text_examples(rows: torch.Tensor, seq_len: int) -> list[dict[str, list[int]]]:
    """Each row of token ids cut into pieces of at most ``seq_len`` (≥ 2 tokens); loss on every token."""
    pieces = [row[i:i + seq_len].tolist() for row in rows for i in range(0, row.numel(), seq_len)]
    return [{"input_ids": p, "labels": p} for p in pieces if len(p) > 1]


def training_examples(tokenizer, dataset: str | None, split: str, text_field: str, seq_len: int,
                      calibration: torch.Tensor) -> tuple[list[dict[str, list[int]]], str]:
    """Examples ``{input_ids, labels}`` and the format read: an Alpaca .json/.jsonl file, any other text
    source (non-overlapping ``seq_len`` windows), or with ``dataset`` None the calibration windows."""
    records = alpaca_records(dataset) if dataset is not None else None
    if records is not None:
        examples, kind = alpaca_examples(tokenizer, records, seq_len), "alpaca"
    elif dataset is not None:
        ids = tokenize(tokenizer, load_text(dataset, split, text_field).text)
        examples, kind = text_examples(ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len), seq_len), "text"
    else:
        examples, kind = text_examples(calibration, seq_len), "calibration"
    if not examples:
        raise ValueError(f"{dataset}: no training example of at most {seq_len} tokens")
    return examples, kind


def pad_batch(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: pad id 0, attention mask 0, label -100."""
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(e["input_ids"]), torch.tensor(e["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def make_trainer(model, args, examples, teacher=None, top_k: int = 0):
    """An HF ``Trainer`` (label loss) or, with a teacher, one whose loss is :func:`top_k_kl` on the
    positions that carry labels."""
    # deferred: transformers' Trainer takes seconds to import; only this step's training needs it
    from transformers import Trainer

    class DistillTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            with torch.no_grad():
                target = teacher(**inputs).logits
            mask = (labels[:, 1:] != -100).float()
            loss = top_k_kl(outputs.logits[:, :-1], target[:, :-1], mask, top_k, "vocabulary")
            return (loss, outputs) if return_outputs else loss

    if teacher is None:
        return Trainer(model=model, args=args, train_dataset=examples, data_collator=pad_batch)
    trainer = DistillTrainer(model=model, args=args, train_dataset=examples, data_collator=pad_batch)
    trainer.model_accepts_loss_kwargs = False  # our loss is a per-micro-batch mean: divide by accumulation
    return trainer


def shown_as_progress(trainer, progress) -> None:
    """The trainer's optimizer steps on the run's progress display (a bar, or plain lines at its interval,
    naming the step for an error's one line), instead of the dict of every log that transformers'
    ``PrinterCallback`` prints on standard output (``disable_tqdm``), even under ``--quiet``."""
    # deferred: as Trainer above
    from transformers import PrinterCallback, TrainerCallback

    class OptimizerSteps(TrainerCallback):
        steps = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.steps = progress.track(range(state.max_steps), "LoRA optimizer steps")
            next(self.steps, None)

        def on_step_end(self, args, state, control, **kwargs):
            next(self.steps, None)

        def on_train_end(self, args, state, control, **kwargs):
            self.steps.close()

    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(OptimizerSteps())


def loss_plot(history: list[float], title: str) -> bytes:
    """PNG of the training loss per optimizer step (matplotlib Agg, no pyplot state)."""
    # deferred: matplotlib is needed only to draw a plot
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 3), dpi=100)
    axes = figure.subplots()
    axes.plot(range(1, len(history) + 1), history, marker="." if len(history) < 50 else None)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("training loss")
    axes.set_title(title)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _whole(session: ModifierSession) -> contextlib.AbstractContextManager:
    """Every weight of the session's model in host memory for the block (a no-op in memory)."""
    model, adapter = session.model, session.adapter
    return session.placed(*range(len(session.layers)), adapter.embeddings(model), adapter.final_norm(model),
                          adapter.lm_head(model), on_device=False)


@register
class LoRARecovery(Modifier):
    """Recover quality lost to compression with LoRA on every attention/MLP projection, then merge.

    HF ``Trainer`` (so ``accelerate launch`` / ``torchrun`` train data-parallel); ``batch_size`` is the
    global batch: ``micro_batch_size`` × gradient accumulation × processes. Data: a local Alpaca
    .json/.jsonl (loss on responses), any text source, or by default the calibration windows (loss on
    every token). ``distill: true`` replaces the labels by top-k KL to the dense model's logits. The
    adapters are merged (``merge_and_unload``), so the output stays a stock checkpoint; ``save_adapter``
    also writes them to ``lora_adapter/`` (relative to the weights before this step).
    ``needs_reference`` is a class flag: an in-memory model is copied to CPU before the recipe runs even
    without ``distill``; from a model source the dense teacher is only loaded when ``distill`` asks.
    """

    needs_reference: ClassVar[bool] = True
    needs: ClassVar[tuple[str, ...]] = ("training data", "dense teacher logits (distill)")
    example: ClassVar[tuple[str, ...]] = ("LoRARecovery<max_steps:2,batch_size:2,micro_batch_size:2>",)

    r: PositiveInt = Field(8, description="LoRA rank (higher: more capacity and memory)")
    alpha: PositiveFloat = Field(16, description="LoRA scale numerator: update = alpha / r · B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input")
    lr: PositiveFloat = Field(1e-4, description="peak learning rate (linear decay, AdamW)")
    epochs: PositiveFloat = Field(2, description="passes over the training examples")
    max_steps: PositiveInt | None = Field(None, description="stop after this many optimizer steps")
    batch_size: PositiveInt = Field(64, description="global batch (examples per optimizer step)")
    micro_batch_size: PositiveInt = Field(4, description="examples per forward on each process")
    seq_len: PositiveInt = Field(512, description="tokens per example (longer ones are truncated)")
    dataset: str | None = Field(None, description="Alpaca .json/.jsonl, a text source (load_text), "
                                                  "or null: the calibration windows")
    split: str = Field("train", description="split of a text source")
    text_field: str = Field("text", description="field of a text source's records")
    max_samples: PositiveInt | None = Field(None, description="use only the first N shuffled examples")
    distill: bool = Field(False, description="train on the dense model's top-k logits instead of labels")
    top_k: PositiveInt = Field(64, description="teacher tokens per position kept for distillation")
    targets: list[Literal[PROJECTIONS]] | None = Field(  # type: ignore[valid-type]
        None, min_length=1, description="projections that get adapters (default: every linear projection the "
        "architecture has: all 7, or on a mixture-of-experts model the attention's 4, its experts being 3-D "
        "tensors, not linears)")
    save_adapter: bool = Field(False, description="also write the adapter to lora_adapter/ in the output")
    seed: int = Field(0, description="seed of shuffling, LoRA init and dropout")

    @model_validator(mode="after")
    def _batch_divides(self) -> "LoRARecovery":
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of micro_batch_size "
                             f"{self.micro_batch_size}")
        return self

    def check_sources(self) -> None:
        """``dataset`` can be read (before the model loads): an Alpaca file, or a text source's pre-flight."""
        if self.dataset is None or alpaca_records_file(self.dataset):
            return
        try:
            check_text(self.dataset, self.split, self.text_field, 0)
        except RecipeError as exc:
            raise self.fail(exc.detail, field="dataset") from None

    def projections(self, model_type: str) -> list[str]:
        """``targets``, or by default every projection that is a linear on ``model_type`` (peft's
        ``all-linear``: a mixture-of-experts MLP's expert tensors are not linears)."""
        if self.targets is not None:
            return list(self.targets)
        return ADAPTERS[model_type].linear_roles(PROJECTIONS) if model_type in ADAPTERS else list(PROJECTIONS)

    def working_memory(self, shape, tokens: int) -> int:
        """Training's peak beyond the weights, for one micro-batch of ``T = micro_batch_size × seq_len`` tokens:
        autograd's saved activations through every layer, ``T (8 h + 6 I + 1.5 q + 2 r a)`` values per layer
        in the model's dtype (``q``: the query width, ``a``: the adapted projections; fitted to the tensors
        ``torch.autograd.graph.saved_tensors_hooks`` sees on Llama, and checked against them on four
        architectures in the tests; an MoE layer counts 8 experts' widths per token), the fp32 logits four
        times (the logits, their shifted copy, the log-softmax, its gradient; with ``distill`` the teacher's
        logits once more), and the adapters' fp32 weights, gradients and two AdamW moments."""
        targets = self.projections(shape.model_type)
        h, d, r, adapted = shape.hidden_size, shape.head_dim, self.r, len(targets)
        step_tokens = self.micro_batch_size * self.seq_len
        saved = adapters = 0
        for layer in shape.layers:
            q, kv, width = layer.num_heads * d, layer.num_kv_heads * d, layer.intermediate_size
            mlp = shape.token_mlp_width(width, routed=8)
            saved += 8 * h + 6 * mlp + 1.5 * q + 2 * r * adapted
            sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
                     "gate_proj": h + width, "up_proj": h + width, "down_proj": width + h}
            adapters += r * sum(sizes[role] for role in targets)
        logits = (5 if self.distill else 4) * step_tokens * shape.vocab_size * 4
        return int(step_tokens * saved * shape.dtype_bytes + logits + 16 * adapters)

    def check(self, shape) -> None:
        problem = roles_problem(shape.model_type, self.projections(shape.model_type))
        if problem:
            raise self.fail(problem, field="targets")

    def apply(self, session: ModifierSession) -> dict[str, Any]:
        # deferred: accelerate and peft are needed only when this step trains
        from accelerate import PartialState
        from peft import LoraConfig, get_peft_model

        model, start = session.model, time.perf_counter()
        examples, kind = training_examples(session.tokenizer, self.dataset, self.split, self.text_field,
                                           self.seq_len, session.calibration)
        random.Random(self.seed).shuffle(examples)
        examples = examples[:self.max_samples]
        processes = PartialState(cpu=session.device.type == "cpu").num_processes  # CPU: gloo DDP too
        if self.batch_size % (self.micro_batch_size * processes):
            raise self.fail(f"batch_size {self.batch_size} is not divisible by micro_batch_size × "
                            f"{processes} processes", field="batch_size")
        home = next(model.parameters()).device
        trainable = {name: param.requires_grad for name, param in model.named_parameters()}
        torch.manual_seed(self.seed)
        targets = self.projections(session.model.config.model_type)
        modules = [session.adapter.path(role).rsplit(".", 1)[-1] for role in session.adapter.module_roles(targets)]
        config = LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                            target_modules=modules, task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, config)
        history, steps = self._train(session, peft_model, examples, processes)
        adapter = self._adapter_files(peft_model) if self.save_adapter else None
        merged = peft_model.merge_and_unload()
        if merged is not model:
            raise RuntimeError("peft merge_and_unload returned a different model object")
        for name, param in model.named_parameters():
            param.requires_grad_(trainable[name])
        model.to(home).eval()
        for name, data in (adapter or {}).items():  # a subdirectory: stock loaders must not mistake the
            session.outputs.add_artifact(f"{ADAPTER_DIR}/{name}", data)  # output for an adapter
        session.outputs.add_artifact("lora_recovery_loss.png", loss_plot(history, f"LoRARecovery ({kind})"))
        return {"format": kind, "examples": len(examples), "steps": steps, "processes": processes,
                "loss_history": history, "loss_first": history[0], "loss_last": history[-1],
                "distill": self.distill, "targets": targets, "wall_s": time.perf_counter() - start}

    def _train(self, session: ModifierSession, peft_model, examples, processes: int) -> tuple[list[float], int]:
        # deferred: as Trainer above
        from transformers import TrainingArguments

        with tempfile.TemporaryDirectory() as scratch:
            args = TrainingArguments(
                output_dir=scratch, per_device_train_batch_size=self.micro_batch_size,
                gradient_accumulation_steps=self.batch_size // (self.micro_batch_size * processes),
                num_train_epochs=self.epochs, max_steps=self.max_steps or -1, learning_rate=self.lr,
                lr_scheduler_type="linear", optim="adamw_torch", logging_steps=1, save_strategy="no",
                report_to="none", disable_tqdm=True, remove_unused_columns=False, seed=self.seed,
                use_cpu=session.device.type == "cpu")
            # the dense teacher: from a model source a skeleton read from the files, loaded whole for training
            reference = session.reference if self.distill else None
            with _whole(reference) if reference is not None else contextlib.nullcontext():
                teacher = None if reference is None else reference.model.to(args.device).eval().requires_grad_(False)
                trainer = make_trainer(peft_model, args, examples, teacher, self.top_k)
                shown_as_progress(trainer, session.progress)
                trainer.train()
                if teacher is not None:
                    teacher.to("cpu")
        history = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
        return history, trainer.state.global_step

    @staticmethod
    def _adapter_files(peft_model) -> dict[str, bytes]:
        with tempfile.TemporaryDirectory() as scratch:
            peft_model.save_pretrained(scratch)
            return {p.name: p.read_bytes() for p in Path(scratch).iterdir() if p.is_file()}
