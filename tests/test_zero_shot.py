"""Offline lm-eval tasks: configs mirror the stock ones, rows match the sources, accuracies match a hand scorer."""
import inspect
import json
from pathlib import Path

import pytest
import torch

from recipe_engine.errors import SourceError
from recipe_engine.evaluation import task_data
from recipe_engine.evaluation.zeroshot import TASKS_DIR, run_harness, summarize, zero_shot
from tests.helpers import requires_smollm2, shared_data

STOCK = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml", "piqa": "piqa/piqa.yaml",
         "hellaswag": "hellaswag/hellaswag.yaml", "winogrande": "winogrande/default.yaml",
         "boolq": "super_glue/boolq/default.yaml", "lambada_openai": "lambada/lambada_openai.yaml"}
DATA_SOURCE_KEYS = {"custom_dataset", "dataset_kwargs", "tag", "training_split", "validation_split", "test_split"}
ROWS = {"arc_easy": 2376, "arc_challenge": 1172, "piqa": 1838, "hellaswag": 10042, "winogrande": 1267,
        "boolq": 3270, "lambada_openai": 5153}
needs_data = pytest.mark.skipif(not (shared_data() / "arc").is_dir(), reason="needs shared/data")


def load_task_yaml(path: Path) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=True)


def comparable(value):
    """Functions compare by source text (the stock file and our import may be two module objects)."""
    return inspect.getsource(value) if callable(value) else value


def evaluated_split(config: dict) -> str:
    return config.get("test_split") or config["validation_split"]


def test_every_offline_task_has_a_config():
    assert sorted(p.stem for p in TASKS_DIR.glob("*.yaml")) == sorted(task_data.LOCAL_TASKS) == sorted(STOCK)


@pytest.mark.parametrize("task", sorted(STOCK))
def test_offline_config_mirrors_stock_task(task):
    import lm_eval

    stock = load_task_yaml(Path(lm_eval.__file__).parent / "tasks" / STOCK[task])
    local = load_task_yaml(TASKS_DIR / f"{task}.yaml")
    assert local["task"] == task
    assert local["dataset_kwargs"] == {"local_task": task}
    assert local["custom_dataset"] is task_data.local_dataset
    assert evaluated_split(local) == evaluated_split(stock) == task_data.SPLITS[task]
    keys = (set(stock) | set(local)) - DATA_SOURCE_KEYS
    assert {k: comparable(local.get(k)) for k in keys} == {k: comparable(stock.get(k)) for k in keys}


@needs_data
@pytest.mark.parametrize("task", sorted(ROWS))
def test_local_dataset_has_the_stock_split_and_row_count(task):
    table = task_data.local_dataset(task, version=1.0)
    assert list(table) == [task_data.SPLITS[task]]
    assert table[task_data.SPLITS[task]].num_rows == ROWS[task]
    assert len(task_data.fingerprint(task)) == 64


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@needs_data
def test_olmo_piqa_and_winogrande_equal_the_official_files():
    piqa = task_data.local_dataset("piqa")["validation"].to_list()
    labels = [int(x) for x in (shared_data() / "piqa" / "valid-labels.lst").read_text().split()]
    official = [dict(r, label=y) for r, y in zip(_jsonl(shared_data() / "piqa" / "valid.jsonl"), labels)]
    assert piqa == official
    wino = task_data.local_dataset("winogrande")["validation"].to_list()
    official = [{k: r[k] for k in ("sentence", "option1", "option2", "answer")}
                for r in _jsonl(shared_data() / "winogrande" / "dev.jsonl")]
    assert wino == official


@needs_data
def test_arc_and_boolq_rows_in_hf_schema():
    arc = task_data.local_dataset("arc_easy")["test"][0]
    assert arc["question"].startswith("Which statement best explains why photosynthesis")
    assert arc["choices"]["label"] == ["A", "B", "C", "D"] and arc["answerKey"] in arc["choices"]["label"]
    boolq = task_data.local_dataset("boolq")["validation"]
    assert boolq[0]["passage"].startswith("Ethanol fuel -- ") and boolq[0]["label"] == 0
    assert sum(boolq["label"]) == 2033  # SOURCES.md: true 2033, false 1237


def test_unknown_offline_task_is_a_one_line_error():
    with pytest.raises(SourceError, match="no offline config for task.*mmlu.*task_data: hub"):
        zero_shot(None, None, ["mmlu"], 5, "cpu")


def test_missing_data_names_what_to_provide(tmp_path, monkeypatch):
    monkeypatch.setenv("RECIPE_DATA_DIR", str(tmp_path))
    with pytest.raises(SourceError, match="arc/ARC-Easy-Test.jsonl.*RECIPE_DATA_DIR"):
        zero_shot(None, None, ["arc_easy"], 5, "cpu")


def continuation_loglik(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context): whole string tokenized once, split at the context's token count."""
    whole = tokenizer(context + continuation)["input_ids"]
    n_context = len(tokenizer(context)["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([whole])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return float(sum(logp[i - 1, whole[i]] for i in range(n_context, len(whole))))


def hand_accuracy(model, tokenizer, docs: list[tuple[str, list[str], int]]) -> tuple[float, float]:
    """(acc, acc_norm) with the harness's definitions: argmax loglik, argmax loglik / len(choice)."""
    acc = acc_norm = 0
    for context, choices, gold in docs:
        lls = [continuation_loglik(model, tokenizer, context, " " + choice) for choice in choices]
        acc += max(range(len(lls)), key=lambda i: lls[i]) == gold
        acc_norm += max(range(len(lls)), key=lambda i: lls[i] / len(choices[i])) == gold
    return acc / len(docs), acc_norm / len(docs)


@pytest.mark.slow
@needs_data
@requires_smollm2
def test_offline_arc_easy_and_piqa_match_hand_scoring(smollm2):
    model, tokenizer = smollm2
    n = 10
    arc = task_data.local_dataset("arc_easy")["test"].select(range(n))
    piqa = task_data.local_dataset("piqa")["validation"].select(range(n))
    reference = {
        "arc_easy": hand_accuracy(model, tokenizer, [
            (f"Question: {d['question']}\nAnswer:", d["choices"]["text"], d["choices"]["label"].index(d["answerKey"]))
            for d in arc]),
        "piqa": hand_accuracy(model, tokenizer, [
            (f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], d["label"]) for d in piqa]),
    }
    summary = summarize(run_harness(model, tokenizer, ["arc_easy", "piqa"], n, "local"), ["arc_easy", "piqa"],
                        "local")
    for task, (acc, acc_norm) in reference.items():
        got = summary.tasks[task]
        assert got.samples == n
        assert (got.acc, got.acc_norm) == pytest.approx((acc, acc_norm), abs=1e-9), task
        assert got.metric == "acc_norm" and got.value == got.acc_norm
    assert reference["arc_easy"][1] > 0.3  # not a degenerate model: above chance (0.25); 0.40 observed
    assert summary.average == pytest.approx((reference["arc_easy"][1] + reference["piqa"][1]) / 2)
