"""``recipe eval`` on tiny saved models, and the recipe ``evaluate:`` block with its gate."""
import json
from pathlib import Path
from importlib.metadata import version

import pytest
import torch

import recipe_engine
from recipe_engine.cli import main
from recipe_engine.errors import QualityGateError
from recipe_engine.evaluation import perplexity
from recipe_engine.recipe.modifier import Modifier
from recipe_engine.recipe.schema import recipe_from_dict
from tests.helpers import BYTE_VOCAB, CharTokenizer, byte_tokenizer, reference_fingerprint, shared_data, tiny_model

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 6  # 480 bytes


@pytest.fixture
def saved(tmp_path):
    """A tiny model + byte tokenizer saved as an HF dir, a text file, and a copy with fewer layers."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    dirs = {}
    for name, layers in (("dense", 4), ("shallow", 2)):
        model = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=layers)
        model.save_pretrained(tmp_path / name, safe_serialization=True)
        byte_tokenizer().save_pretrained(tmp_path / name)
        dirs[name] = tmp_path / name
    return dirs["dense"], dirs["shallow"], text


def test_eval_cli_writes_json_record(saved, tmp_path, capsys):
    dense, _, text = saved
    report = json.loads((Path(__file__).parent / "data" / "report_format0" / "report.json").read_text())
    report["recipe"]["sha256"] = "ab" * 32  # a recipe output's report names the recipe that made it
    (dense / "report.json").write_text(json.dumps(report))
    out = tmp_path / "eval.json"
    code = main(["eval", str(dense), "--dataset", str(text), "--seq-len", "64", "--limit", "3", "--device", "cpu",
                 "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    weights = reference_fingerprint(dense)
    assert record["model"] == {"spec": str(dense), "location": str(dense), "recipe_sha256": "ab" * 32,
                               "resolved_sha256": report["recipe"]["resolved_sha256"], "weights_sha256": weights}
    ppl = record["perplexity"]
    assert (ppl["windows"], ppl["windows_available"], ppl["seq_len"], ppl["tokens"]) == (3, 7, 64, 3 * 63)
    assert len(ppl["fingerprint"]) == 64 and ppl["origin"] == str(text)
    assert record["lm_eval_version"] == version("lm_eval")
    from recipe_engine.sources.models import load_model

    model, tokenizer, _ = load_model(str(dense))
    assert ppl["ppl"] == pytest.approx(perplexity(model, tokenizer, TEXT, 64, 3)["ppl"], rel=1e-6)
    printed = capsys.readouterr().out
    assert "first 3 of 7 windows" in printed and "--limit" in printed


@pytest.mark.slow
@pytest.mark.skipif(not (shared_data() / "arc").is_dir(), reason="needs shared/data")
def test_eval_cli_zero_shot_record(saved, tmp_path, capsys):
    dense, _, _ = saved
    out = tmp_path / "zs.json"
    assert main(["eval", str(dense), "--no-ppl", "--tasks", "arc_easy", "winogrande", "--task-limit", "4",
                 "--device", "cpu", "--json", str(out)]) == 0
    zero = json.loads(out.read_text())["zero_shot"]
    assert zero["data"] == "local" and zero["limit"] == 4 and zero["lm_eval_version"] == version("lm_eval")
    arc, wino = zero["tasks"]["arc_easy"], zero["tasks"]["winogrande"]
    assert (arc["metric"], wino["metric"]) == ("acc_norm", "acc")
    assert (arc["samples"], arc["samples_available"], wino["samples_available"]) == (4, 2376, 1267)
    assert arc["fingerprint"] == "ce32a0774b4beb1977d2c6b16dda5dd2b24fdc9c7f506882c452678676bd09be"  # SOURCES.md
    assert zero["average"] == pytest.approx((arc["acc_norm"] + wino["acc"]) / 2)
    assert "Avg." in capsys.readouterr().out


def test_eval_cli_retained_against_baseline(saved, tmp_path):
    dense, shallow, text = saved
    common = ["--dataset", str(text), "--seq-len", "64", "--device", "cpu"]
    assert main(["eval", str(dense), *common, "--json", str(tmp_path / "a.json")]) == 0
    assert main(["eval", str(shallow), *common, "--baseline", str(tmp_path / "a.json"),
                 "--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert b["retained"]["perplexity"] == pytest.approx(a["perplexity"]["ppl"] / b["perplexity"]["ppl"])
    assert b["baseline"]["file"] == str(tmp_path / "a.json")


def test_eval_cli_text_shorter_than_a_window_exits_2(saved, capsys):
    dense, _, text = saved
    assert main(["eval", str(dense), "--dataset", str(text), "--seq-len", "4096", "--device", "cpu"]) == 2
    assert "shorter than one window of 4096" in capsys.readouterr().err


class NoisyHead(Modifier):
    """Test double (not registered): adds Gaussian noise to lm_head, so quality drops."""

    scale: float = 1.0

    def apply(self, session):
        with torch.no_grad():
            head = session.model.lm_head.weight
            head.add_(self.scale * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
        return {}


def tiny_recipe(text, step, min_retained, **extra):
    return dict(version=1, name="gate", model="tiny", device="cpu", output="unused",
                calibration=dict(dataset=str(text), samples=2, seq_len=32),
                evaluate=dict(perplexity=dict(dataset=[str(text)], seq_len=64), min_retained=min_retained),
                modifiers=[step], **extra)


def test_evaluate_block_before_after_and_gate(saved):
    _, _, text = saved
    recipe = recipe_from_dict(tiny_recipe(text, "FuseNorm", 0.9))
    _, report = recipe_engine.apply(recipe, model=tiny_model(), tokenizer=CharTokenizer(), write=False,
                                    progress=False)
    evaluation = report.evaluation
    assert evaluation.retained.perplexity == pytest.approx(1.0, abs=1e-4)  # FuseNorm preserves outputs
    assert evaluation.quality_gate == "passed" and evaluation.after.perplexity.windows == 7

    recipe = recipe_from_dict(tiny_recipe(text, "FuseNorm", 0.9)).model_copy(update={"modifiers": [NoisyHead()]})
    with pytest.raises(QualityGateError, match="retained perplexity=0.* below min_retained=0.9"):
        recipe_engine.apply(recipe, model=tiny_model(), tokenizer=CharTokenizer(), write=False, progress=False)


def test_apply_cli_quality_gate_exit_code_3(saved, tmp_path):
    import yaml

    dense, _, text = saved
    data = tiny_recipe(text, "FuseNorm", 1.2)  # FuseNorm keeps PPL (retained 1.0) < 1.2: the gate fails
    data.update(model=str(dense), output=str(tmp_path / "out"))
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["apply", str(path), "--quiet"]) == 3
    report = recipe_engine.load_report(tmp_path / "out")
    assert (tmp_path / "out" / "QUALITY_GATE_FAILED").is_file()
    assert report.evaluation.quality_gate == "failed"
    assert report.evaluation.retained.perplexity == pytest.approx(
        report.evaluation.before.perplexity.ppl / report.evaluation.after.perplexity.ppl)
