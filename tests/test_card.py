"""The model card (README.md) of every output: huggingface_hub reads it; its metadata names the base model, the
tool and the source's license; its body lists the steps and the perplexities report.json records; `recipe
card` rewrites it from the report and adds later `recipe eval` records of the same output."""
import json
import re
import shutil

import pytest
import yaml
from huggingface_hub import ModelCard, ModelCardData

from recipe_engine.cli import main
from recipe_engine.io.report import load_report
from tests.helpers import save_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 80
EVALUATE = {"perplexity": {"seq_len": 32, "limit": 3}}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Two outputs of one local source model that has a card (license: mit): GPTQ with evaluation, run from a
    recipe file with an override; ShortGPT then LinearPatch (a non-stock extra), without evaluation."""
    base = tmp_path_factory.mktemp("card")
    source = base / "source-model"
    save_tiny_model(source)
    ModelCard(f"---\n{ModelCardData(license='mit').to_yaml()}\n---\n# a source model\n").save(source / "README.md")
    (base / "cal.txt").write_text(TEXT)
    cases = {"quant": (["GPTQ<group_size:32>"], {"evaluate": {**EVALUATE, "perplexity": {
                 **EVALUATE["perplexity"], "dataset": str(base / "cal.txt")}}}),
             "patch": (["ShortGPT<n:1>", "LinearPatch"], {})}
    for name, (steps, extra) in cases.items():
        recipe = {"version": 1, "name": f"card-{name}", "model": str(source), "device": "cpu",
                  "output": str(base / name), "modifiers": steps, **extra,
                  "calibration": {"dataset": str(base / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2}}
        (base / f"{name}.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
        assert main(["apply", str(base / f"{name}.yaml"), "--quiet", "--set", "calibration.seed=1"]) == 0
    return base


def card(directory):
    return ModelCard.load(directory / "README.md")


@pytest.mark.parametrize("name", ["quant", "patch"])
def test_every_output_has_a_card_the_hub_client_reads(outputs, name):
    data = card(outputs / name)
    assert data.data.base_model is None  # a local source of unknown origin: no hub id to link
    assert "`source-model` compressed by" in data.text  # the body names it by its directory's name
    data = data.data
    assert "recipe" in data.tags and data.library_name == "transformers"
    assert data.pipeline_tag == "text-generation" and data.license == "mit"  # carried over from the source's card
    assert not list(outputs.glob(f".{name}*"))  # written inside the temporary directory renamed into place


def test_card_lists_the_steps_and_the_perplexities_the_run_measured(outputs):
    report = json.loads((outputs / "quant" / "report.json").read_text())
    quant, patch = card(outputs / "quant"), card(outputs / "patch")
    evaluation = report["evaluation"]
    before, after = evaluation["before"]["perplexity"]["ppl"], evaluation["after"]["perplexity"]["ppl"]
    row = next(line for line in quant.text.splitlines() if line.startswith("| perplexity"))
    assert re.findall(r"\| (\d+\.\d\d) ", row) == [f"{before:.2f}", f"{after:.2f}"]
    assert f"{before / after:.1%}" in row
    assert quant.data.eval_results[0].metric_type == "perplexity"
    assert quant.data.eval_results[0].metric_value == pytest.approx(after, abs=1e-4)
    assert quant.data.base_model_relation == "quantized" and "int4 symmetric" in quant.text
    assert "quantization_log.csv" in quant.text
    assert patch.data.to_dict().get("base_model_relation") is None  # removing layers is no hub relation
    steps = [line.split("`")[1] for line in patch.text.splitlines() if re.match(r"\| \d+ \| `", line)]
    assert steps == [s["modifier"] for s in json.loads((outputs / "patch" / "report.json").read_text())["steps"]]
    layers = report["before"]["layers"], report["after"]["layers"]
    assert f"| decoder layers | {layers[0]} | {layers[1]} |" in quant.text
    assert report["data"]["fingerprint"] in quant.text


def test_card_says_how_to_load_and_how_to_reproduce(outputs):
    quant, patch = card(outputs / "quant").text, card(outputs / "patch").text
    assert "recipe_engine.load_model" in patch and "LinearPatch" in patch  # a non-stock extra
    assert "recipe_engine.load_model" not in quant and "AutoModelForCausalLM.from_pretrained" in quant
    assert "recipe apply quant.yaml --set calibration.seed=1" in quant  # the recipe by its file name


def test_card_command_rewrites_the_card_and_adds_a_later_evaluation(outputs, tmp_path):
    out = tmp_path / "quant"
    shutil.copytree(outputs / "quant", out)
    written = (out / "README.md").read_text()
    (out / "README.md").unlink()
    assert main(["card", str(out)]) == 0
    assert (out / "README.md").read_text() == written
    record = tmp_path / "eval.json"
    evaluate(out, record, outputs / "cal.txt")
    assert main(["card", str(out), "--eval", str(record)]) == 0
    later = json.loads(record.read_text())["perplexity"]["ppl"]
    rewritten = card(out)
    assert f"{later:.2f} (" in rewritten.text
    assert [r.metric_value for r in rewritten.data.eval_results][-1] == pytest.approx(later, abs=1e-4)
    assert json.loads(record.read_text())["model"]["weights_sha256"] == load_report(out).weights_sha256
    for field in ("weights_sha256", "resolved_sha256"):  # other weights; another resolved recipe
        other = json.loads(record.read_text())
        other["model"][field] = "0" * 64
        (tmp_path / "other.json").write_text(json.dumps(other))
        assert main(["card", str(out), "--eval", str(tmp_path / "other.json")]) == 2
        assert card(out).text == rewritten.text


def evaluate(directory, record, text):
    assert main(["eval", str(directory), "--dataset", str(text), "--seq-len", "16", "--limit", "2",
                 "--device", "cpu", "--json", str(record)]) == 0


def test_card_shows_zero_shot_accuracy_and_what_it_retained(outputs):
    from recipe_engine.io.card import model_card
    from recipe_engine.io.report import load_report

    report = load_report(outputs / "quant")
    zero = lambda value: {"tasks": {"arc_easy": {"metric": "acc_norm", "value": value}}, "average": value}
    evaluation = report.evaluation.model_copy(update={
        "before": {**report.evaluation.before, "zero_shot": zero(0.5)},
        "after": {**report.evaluation.after, "zero_shot": zero(0.4)},
        "retained": {**report.evaluation.retained, "zero_shot": 0.4 / 0.5}})
    card = model_card(report.model_copy(update={"evaluation": evaluation}), outputs / "quant")
    lines = card.text.splitlines()
    assert "| arc_easy acc_norm | 0.5000 | 0.4000 | |" in lines
    assert "| zero-shot average | 0.5000 | 0.4000 | 80.0% |" in lines
    assert [(r.dataset_name, r.metric_type, r.metric_value) for r in card.data.eval_results][1:] == \
        [("arc_easy", "acc_norm", 0.4)]


def test_a_gguf_sources_license_is_read_once_per_file(tmp_path, monkeypatch):
    """A GGUF source's ``general.license`` is parsed from the file once (GGUFReader reads every metadata
    array, seconds for a real vocabulary) and then read from beside the converted checkpoint."""
    import gguf

    from recipe_engine.io.card import source_license
    from recipe_engine.io.models import ModelSource, converted_gguf
    from tests.helpers import write_tiny_gguf

    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "cache"))
    files = {"apache-2.0": write_tiny_gguf(tmp_path / "tiny.gguf", license="apache-2.0"),
             "mit": write_tiny_gguf(tmp_path / "other.gguf", license="mit", layers=3)}
    sources = {}
    for license, path in files.items():
        converted_gguf(path)
        sources[license] = ModelSource(spec=str(path), kind="gguf", location=str(path))
    assert source_license(sources["apache-2.0"]) == "apache-2.0"
    reads = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path: reads.append(path) or reader(path))
    assert source_license(sources["apache-2.0"]) == "apache-2.0" and reads == []  # from beside the checkpoint
    assert source_license(sources["mit"]) == "mit" and len(reads) == 1  # another file: its own
