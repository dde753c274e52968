"""The evaluation task registry and the typed evaluation results: every task name has one kind, and a result
written by ``to_json`` reads back by ``from_json`` to the same JSON, key for key and in order."""
from __future__ import annotations

import json

import pytest

from recipe_engine.errors import RecipeError
from recipe_engine.evaluation import registry
from recipe_engine.evaluation.run import retained
from recipe_engine.records.evaluation import Evaluation, Retained
from recipe_engine.records.report import EvaluationRecord

RECORD = {
    "perplexity": {"dataset": "wikitext2", "origin": "wiki.test.raw", "ppl": 21.5, "nll": 3.068, "tokens": 62,
                   "windows": 2, "windows_available": 9, "seq_len": 32, "fingerprint": "ab"},
    "zero_shot": {"tasks": {
        "arc_easy": {"metric": "acc_norm", "value": 0.5, "samples": 4, "samples_available": 2376, "acc": 0.25,
                     "acc_stderr": 0.1, "acc_norm": 0.5, "acc_norm_stderr": None, "fingerprint": "cd"},
        "winogrande": {"metric": "acc", "value": 0.75, "samples": 4, "samples_available": 1267, "acc": 0.75,
                       "acc_stderr": 0.2, "fingerprint": None}},
        "data": "local", "average": 0.625, "limit": 4, "lm_eval_version": "0.4.9", "device": "cpu"},
    "generation": {"tasks": {"humaneval": {
        "metric": "pass@1", "value": 0.5, "passed": 1, "samples": 2, "samples_available": 164, "max_new_tokens": 8,
        "stop": ["\nclass"], "fingerprint": "ef", "generation_s": 1.5, "check_s": 0.25, "sandbox": "namespaces",
        "problems": {"HumanEval/0": {"passed": True, "completion": "    return 1\n"},
                     "HumanEval/1": {"passed": False, "completion": ""}}}},
        "average": 0.5, "limit": 2, "device": "cpu", "batch_size": 8},
}


def test_a_result_reads_back_to_the_same_json():
    evaluation = Evaluation.from_json(RECORD)
    assert json.dumps(evaluation.to_json()) == json.dumps(RECORD)  # the same keys in the same order
    assert evaluation.zero_shot.tasks["winogrande"].acc_norm is None and evaluation.perplexity.limited
    assert evaluation.generation.tasks["humaneval"].problems["HumanEval/0"].passed
    only = {"perplexity": RECORD["perplexity"]}
    assert Evaluation.from_json(only).to_json() == only  # a section not measured stays absent


def test_retained_keeps_which_sections_were_compared():
    dense = Evaluation.from_json(RECORD)
    zero = json.loads(json.dumps(RECORD))
    zero["generation"]["average"] = 0.0
    kept = retained(Evaluation.from_json(zero), dense)
    assert kept.to_json() == {"perplexity": 1.0, "zero_shot": 1.0, "generation": None}
    assert kept.fractions() == {"perplexity": 1.0, "zero_shot": 1.0}  # no ratio: not gated
    assert Retained.from_json(kept.to_json()) == kept
    record = EvaluationRecord.model_validate({"before": RECORD, "after": RECORD, "retained": kept.to_json()})
    assert json.loads(record.model_dump_json()) == {"before": RECORD, "after": RECORD, "retained": kept.to_json(),
                                                    "quality_gate": None}


def test_every_task_name_has_one_kind():
    names = registry.names()
    assert names[-2:] == ("humaneval", "gsm8k") and "arc_easy" in registry.names(registry.MULTIPLE_CHOICE)
    assert registry.kind_of("humaneval").name == registry.GENERATION and not registry.kind_of("gsm8k").streams
    assert registry.kind_of("mmlu").name == registry.MULTIPLE_CHOICE  # lm-eval's index: its pre-flight decides
    groups = registry.by_kind(["gsm8k", "piqa", "humaneval", "mmlu"])
    assert [(kind.section, tasks) for kind, tasks in groups] == [("zero_shot", ["piqa", "mmlu"]),
                                                                 ("generation", ["gsm8k", "humaneval"])]
    with pytest.raises(RecipeError, match="registered twice"):
        registry.register_task("humaneval", registry.GENERATION)
