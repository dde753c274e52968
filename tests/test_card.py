"""The model card (README.md) of every output: huggingface_hub reads it; its metadata names the base model, the
tool and the source's license; its body lists the steps and the perplexities report.json records; `recipe
card` rewrites it from the report and adds later `recipe eval` records of the same output."""
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard, ModelCardData

from recipe_engine.cli import main
from recipe_engine.records.report import load_report
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
    from recipe_engine.records.card import model_card
    from recipe_engine.records.report import load_report

    report = load_report(outputs / "quant")
    zero = lambda value: {"tasks": {"arc_easy": {"metric": "acc_norm", "value": value}}, "average": value}
    measured = report.evaluation.model_dump()  # the JSON of report.json's evaluation, read back typed
    evaluation = report.evaluation.model_validate({
        **measured, "before": {**measured["before"], "zero_shot": zero(0.5)},
        "after": {**measured["after"], "zero_shot": zero(0.4)},
        "retained": {**measured["retained"], "zero_shot": 0.4 / 0.5}})
    card = model_card(report.model_copy(update={"evaluation": evaluation}), outputs / "quant")
    lines = card.text.splitlines()
    assert "| arc_easy acc_norm | 0.5000 | 0.4000 | |" in lines
    assert "| zero-shot average | 0.5000 | 0.4000 | 80.0% |" in lines
    assert [(r.dataset_name, r.metric_type, r.metric_value) for r in card.data.eval_results][1:] == \
        [("arc_easy", "acc_norm", 0.4)]


def test_card_shows_generation_pass_at_1_and_what_it_retained(outputs):
    from recipe_engine.records.card import model_card
    from recipe_engine.records.report import load_report

    report = load_report(outputs / "quant")
    run = lambda passed: {"tasks": {"humaneval": {"metric": "pass@1", "value": passed / 24, "passed": passed,
                                                   "samples": 24}}, "average": passed / 24}
    measured = report.evaluation.model_dump()  # the JSON of report.json's evaluation, read back typed
    evaluation = report.evaluation.model_validate({
        **measured, "before": {**measured["before"], "generation": run(17)},
        "after": {**measured["after"], "generation": run(3)},
        "retained": {**measured["retained"], "generation": 3 / 17}})
    card = model_card(report.model_copy(update={"evaluation": evaluation}), outputs / "quant")
    lines = card.text.splitlines()
    assert "| humaneval pass@1 | 0.7083 | 0.1250 | |" in lines
    assert "| generation average | 0.7083 | 0.1250 | 17.6% |" in lines
    assert ("humaneval", "pass@1", 0.125) in [(r.dataset_name, r.metric_type, r.metric_value)
                                              for r in card.data.eval_results]


def test_a_gguf_sources_license_is_read_once_per_file(tmp_path, monkeypatch):
    """A GGUF source's ``general.license`` is parsed from the file once (GGUFReader reads every metadata
    array, seconds for a real vocabulary) and then read from beside the converted checkpoint."""
    import gguf

    from recipe_engine.sources.record import source_license
    from recipe_engine.sources.models import ModelSource
    from recipe_engine.formats.gguf.source import converted_gguf
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


ABSOLUTE = re.compile(r"(?<![\w.])/(tmp|root|home|usr|var|work)\b|site-packages|\\\\")


def no_machine_path(text: str, *paths) -> None:
    assert not ABSOLUTE.search(text), ABSOLUTE.search(text)
    for path in paths:
        assert str(path) not in text


def test_weights_fingerprint_is_the_sha256_of_the_written_safetensors_segments(outputs):
    from tests.helpers import reference_fingerprint

    for name in ("quant", "patch"):
        files = sorted((outputs / name).glob("*.safetensors"))
        assert load_report(outputs / name).weights_sha256 == reference_fingerprint(outputs / name)
    assert [p.name for p in files] == ["model.safetensors", "recipe_extras.safetensors"]  # extras count too


@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-0.5b", "gemma3-270m"])
def test_a_builtin_alias_output_names_its_hub_id_and_no_machine_path(outputs, alias):
    """The report of an alias-sourced output (written before the report kept ``base_model``: found from the
    alias), its calibration text from the package's file: the card links the hub id, shows files by name."""
    from recipe_engine.records.card import model_card
    from recipe_engine.formats.gguf.source import BUILTIN_HUB_IDS
    from recipe_engine.sources.models import builtin_names

    assert sorted(BUILTIN_HUB_IDS) == sorted(builtin_names())  # every shipped alias has its hub id
    report = load_report(outputs / "quant")
    text = "/usr/lib/python3/site-packages/recipe_engine/data/wiki.txt"
    fake = report.model_copy(update={
        "model": report.model.model_copy(update={"spec": alias, "kind": "builtin", "location": "/root/.cache/x",
                                                 "base_model": None}),
        "data": report.data.model_copy(update={"dataset": "wikitext2", "origin": f"{text} [valid: 3 documents]"})})
    made = model_card(fake, outputs / "quant")
    assert made.data.base_model == BUILTIN_HUB_IDS[alias]
    assert f"`{BUILTIN_HUB_IDS[alias]}` compressed by" in made.text
    assert "read from `wiki.txt [valid: 3 documents]`" in made.text
    no_machine_path(made.text, outputs)


def test_a_hub_source_and_an_output_used_as_source_carry_the_hub_id(outputs, tmp_path):
    from recipe_engine.records.card import model_card

    report = load_report(outputs / "quant")
    hub = report.model_copy(update={"model": report.model.model_copy(update={
        "spec": "owner/some-model", "kind": "hub", "location": "owner/some-model", "base_model": None})})
    assert model_card(hub, outputs / "quant").data.base_model == "owner/some-model"
    earlier = tmp_path / "earlier"  # an output of a hub model, then used as the model of another recipe
    shutil.copytree(outputs / "quant", earlier)
    (earlier / "report.json").write_text(hub.to_json())
    local = report.model_copy(update={"model": report.model.model_copy(update={
        "spec": str(earlier), "kind": "local", "location": str(earlier), "base_model": None})})
    assert model_card(local, outputs / "quant").data.base_model == "owner/some-model"
    (earlier / ".recipe_engine.json").unlink()
    (earlier / "recipe.yaml").unlink()  # no longer a recipe output: its report.json is not trusted
    assert model_card(local, outputs / "quant").data.base_model is None


def snapshot(directory):
    return {p.name: (p.lstat().st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in directory.iterdir()}


def refused(capsys, argv, *words):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    return err


def test_card_writes_only_its_own_readme(outputs, tmp_path, capsys):
    """A directory holding a report.json but no output marker keeps its hand-written README.md (--force
    writes it); a README.md that is a directory or a link to a device is never replaced."""
    foreign = tmp_path / "foreign"
    shutil.copytree(outputs / "quant", foreign)
    (foreign / ".recipe_engine.json").unlink()
    (foreign / "recipe.yaml").unlink()
    (foreign / "README.md").write_text("# my own notes\n")
    before = snapshot(foreign)
    refused(capsys, ["card", str(foreign)], str(foreign), "not a recipe output", "--force")
    assert snapshot(foreign) == before
    assert main(["card", str(foreign), "--force"]) == 0
    assert card(foreign).data.license == "mit" and not list(foreign.glob(".README*"))
    out = tmp_path / "out"
    shutil.copytree(outputs / "quant", out)
    (out / "README.md").unlink()
    (out / "README.md").mkdir()
    (out / "README.md" / "keep").write_text("x")
    before = snapshot(out)
    refused(capsys, ["card", str(out), "--force"], "README.md is a directory")
    assert snapshot(out) == before and (out / "README.md" / "keep").read_text() == "x"
    (out / "README.md" / "keep").unlink()
    (out / "README.md").rmdir()
    (out / "README.md").symlink_to("/dev/null")
    before = snapshot(out)
    refused(capsys, ["card", str(out)], "README.md is a symbolic link")
    assert snapshot(out) == before and (out / "README.md").readlink() == Path("/dev/null")


def test_card_on_a_directory_it_cannot_write_is_one_line(outputs, tmp_path, capsys, monkeypatch):
    import errno
    import tempfile

    out = tmp_path / "out"
    shutil.copytree(outputs / "quant", out)
    before = snapshot(out)
    if os.geteuid() != 0:  # root writes into a mode-555 directory: the check below covers a read-only mount
        out.chmod(0o555)
        try:
            refused(capsys, ["card", str(out)], "read-only")
        finally:
            out.chmod(0o755)
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    refused(capsys, ["card", str(out)], "cannot write", "Read-only file system")
    assert snapshot(out) == before


@pytest.fixture(scope="module")
def layered(outputs):
    """Two outputs of one recipe file: ShortGPT n=1 (3 layers) and, with --set, n=2 (2 layers); and a
    `recipe eval --json` record of each."""
    recipe = yaml.safe_load((outputs / "patch.yaml").read_text())
    recipe["modifiers"] = ["ShortGPT<n:1>"]
    (outputs / "short.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    made = {}
    for layers, n in ((3, 1), (2, 2)):
        out = outputs / f"short{layers}"
        assert main(["apply", str(outputs / "short.yaml"), "--quiet", "--output", str(out),
                     "--set", f"modifiers.0.n={n}"]) == 0
        evaluate(out, outputs / f"short{layers}.json", outputs / "cal.txt")
        made[layers] = out
    return made


def test_a_record_of_the_same_recipe_file_with_other_overrides_is_refused(layered, capsys):
    three, two = layered[3], layered[2]
    assert load_report(three).after.layers == 3 and load_report(two).after.layers == 2
    record = two.parent / "short2.json"
    before = snapshot(three)
    refused(capsys, ["card", str(three), "--eval", str(record)], str(record), "other weights")
    assert snapshot(three) == before
    assert main(["card", str(two), "--eval", str(record)]) == 0
    ppl = json.loads(record.read_text())["perplexity"]["ppl"]
    assert f"| {ppl:.2f} (cal.txt, 2 × 16 tokens) |" in card(two).text


def record_variant(good: dict, path: Path, change) -> str:
    """``good`` (a record) changed by ``change``, written to ``path``."""
    record = json.loads(json.dumps(good))
    change(record)
    path.write_text(json.dumps(record))
    return str(path)


def test_an_eval_record_is_bounded_validated_and_escaped(layered, tmp_path, capsys):
    out = layered[2]
    good = json.loads((out.parent / "short2.json").read_text())
    before = snapshot(out)
    big = tmp_path / "big.json"
    with open(big, "wb") as handle:
        handle.truncate(17 << 20)
    refused(capsys, ["card", str(out), "--eval", "/dev/zero"], "/dev/zero", "a character device")
    refused(capsys, ["card", str(out), "--eval", str(tmp_path)], "is a directory")
    os.mkfifo(tmp_path / "fifo")  # opening it would wait for a writer
    refused(capsys, ["card", str(out), "--eval", str(tmp_path / "fifo")], "a FIFO")
    refused(capsys, ["card", str(out), "--eval", str(big)], str(big), "at most")

    variant = lambda name, change: record_variant(good, tmp_path / f"{name}.json", change)
    zero = {"tasks": {"arc_easy": {"metric": "acc", "value": 0.5}}, "average": 0.5}
    cases = {"perplexity.ppl": [lambda r: r["perplexity"].pop("ppl"), lambda r: r["perplexity"].update(ppl="abc"),
                                lambda r: r["perplexity"].update(ppl=float("nan")),
                                lambda r: r["perplexity"].update(ppl=True)],
             "zero_shot.average": [lambda r: r.update(zero_shot={**zero, "average": None}),
                                   lambda r: r.update(zero_shot={"tasks": {}, "average": "high"})],
             "zero_shot.tasks.arc_easy.value": [
                 lambda r: r.update(zero_shot={**zero, "tasks": {"arc_easy": {"metric": "acc", "value": "1"}}})],
             "generation.tasks.humaneval.value": [
                 lambda r: r.update(generation={"tasks": {"humaneval": {"metric": "pass@1", "value": None}},
                                                "average": 0.5})]}
    for field, changes in cases.items():
        for i, change in enumerate(changes):
            path = variant(f"{field}-{i}", change)
            refused(capsys, ["card", str(out), "--eval", path], path, f"field {field}")
    old = variant("old", lambda r: r["model"].pop("weights_sha256"))
    refused(capsys, ["card", str(out), "--eval", old], old, "rerun `recipe eval")
    assert snapshot(out) == before
    injected = "x | y\n## injected <b>bold</b>"
    path = variant("injected", lambda r: (r["perplexity"].update(dataset=injected), r.update(date=injected),
                                          r.update(zero_shot={**zero, "tasks": {injected: zero["tasks"]["arc_easy"]}})))
    assert main(["card", str(out), "--eval", path]) == 0
    lines = card(out).text.splitlines()
    assert not [line for line in lines if line.lstrip().startswith("## injected") or "<b>" in line]
    later = lines.index("| evaluated | perplexity | zero-shot average | generation |")
    rows = lines[later + 2:lines.index("", later)]
    assert len(rows) == 1 and rows[0].count(" | ") == 3  # one row of four cells: no cell break injected
    assert "x \\| y ## injected &lt;b&gt;bold&lt;/b&gt;" in rows[0]
    no_machine_path(card(out).text, out.parent)


def test_an_output_written_before_the_fingerprint_is_fingerprinted_from_its_files(layered, tmp_path):
    """A format-1 report has no weights_sha256: the card fingerprints the directory's files instead."""
    out = tmp_path / "old"
    shutil.copytree(layered[2], out)
    report = json.loads((out / "report.json").read_text())
    del report["weights_sha256"], report["model"]["base_model"]
    (out / "report.json").write_text(json.dumps({**report, "format_version": 1}))
    assert load_report(out).weights_sha256 is None
    assert main(["card", str(out), "--eval", str(layered[2].parent / "short2.json")]) == 0
    assert main(["card", str(out), "--eval", str(layered[2].parent / "short3.json")]) == 2


def test_a_whole_file_fingerprint_of_an_older_engine_is_dropped_or_named(layered, tmp_path, capsys):
    """A format-2 report's weights_sha256 hashed the whole files: it is dropped on reading (the card fingerprints
    the files now), and an eval record holding that older fingerprint is refused with the remedy, not as a
    record of other weights."""
    import hashlib

    out = tmp_path / "older"
    shutil.copytree(layered[2], out)
    whole = hashlib.sha256()
    for path in sorted(out.glob("*.safetensors")):
        whole.update(path.name.encode() + b"\0" + path.read_bytes())
    report = json.loads((out / "report.json").read_text())
    (out / "report.json").write_text(json.dumps({**report, "format_version": 2, "weights_sha256": whole.hexdigest()}))
    assert load_report(out).weights_sha256 is None
    assert main(["card", str(out), "--eval", str(layered[2].parent / "short2.json")]) == 0
    record = json.loads((layered[2].parent / "short2.json").read_text())
    record["model"]["weights_sha256"] = whole.hexdigest()
    (tmp_path / "older.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["card", str(out), "--eval", str(tmp_path / "older.json")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "older `recipe eval`" in error[0] and "rerun `recipe eval" in error[0], error


def test_an_eval_record_whose_figures_disagree_is_refused(layered, tmp_path, capsys):
    """``recipe card --eval`` checks a record's figures against each other before showing them: ppl = exp(nll)
    (relative 1e-6), accuracies, pass rates and averages in [0, 1], an average the mean of its tasks, passed ≤
    samples and value = passed / samples. One line names the file and the field; nothing is written. A record
    at the edges (shares 0 and 1, ppl off by 1e-8) is shown."""
    out = layered[2]
    good = json.loads((out.parent / "short2.json").read_text())
    ppl = good["perplexity"]
    assert ppl["ppl"] == math.exp(ppl["nll"])  # what `recipe eval` wrote: the reference the check holds it to
    zero = {"tasks": {"arc_easy": {"metric": "acc_norm", "value": 0.25, "acc": 0.5, "acc_norm": 0.25, "samples": 8},
                      "piqa": {"metric": "acc", "value": 0.75, "acc": 0.75, "samples": 8}}, "average": 0.5}
    generation = {"tasks": {"humaneval": {"metric": "pass@1", "value": 17 / 24, "passed": 17, "samples": 24}},
                  "average": 17 / 24}
    good = {**good, "zero_shot": zero, "generation": generation}
    task = lambda part, name, **values: lambda r: r[part]["tasks"][name].update(values)
    cases = [("perplexity.ppl", lambda r: r["perplexity"].update(ppl=3.14, nll=math.log(48176)), "48176"),
             ("perplexity.ppl", lambda r: r["perplexity"].update(ppl=ppl["ppl"] * (1 + 2e-6)), "is not exp("),
             ("perplexity.ppl", lambda r: r["perplexity"].update(nll=800.0), "beyond a float"),
             ("perplexity.nll", lambda r: r["perplexity"].pop("nll"), "missing"),
             ("perplexity.nll", lambda r: r["perplexity"].update(nll=-0.5, ppl=math.exp(-0.5)), "negative"),
             ("zero_shot.tasks.arc_easy.value", task("zero_shot", "arc_easy", value=1.25), "not a share"),
             ("zero_shot.tasks.piqa.acc", task("zero_shot", "piqa", acc=-0.01), "not a share"),
             ("zero_shot.tasks.arc_easy.acc_norm", task("zero_shot", "arc_easy", acc_norm=2), "not a share"),
             ("zero_shot.average", lambda r: r["zero_shot"].update(average=0.6), "not the mean"),
             ("zero_shot.average", lambda r: r["zero_shot"].update(average=-0.5), "not a share"),
             ("generation.tasks.humaneval.value", task("generation", "humaneval", value=0.5), "17/24"),
             ("generation.tasks.humaneval.passed", task("generation", "humaneval", passed=25), "25 passed of 24"),
             ("generation.tasks.humaneval.passed", task("generation", "humaneval", passed=-1), "integer ≥ 0"),
             ("generation.tasks.humaneval.samples", task("generation", "humaneval", samples=0), "integer ≥ 1"),
             ("generation.tasks.humaneval.samples", task("generation", "humaneval", samples=24.0), "integer ≥ 1"),
             ("generation.average", lambda r: r["generation"].update(average=0.5), "not the mean")]
    before = snapshot(out)
    for i, (field, change, why) in enumerate(cases):
        path = record_variant(good, tmp_path / f"{i}.json", change)
        typed = why in ("missing", "integer ≥ 0", "integer ≥ 1")  # a wrong type; else figures that disagree
        remedy = () if typed else ("rerun `recipe eval",)
        refused(capsys, ["card", str(out), "--eval", path], f"--eval {path}: field {field}: ", why, *remedy)
        assert snapshot(out) == before and not list(out.parent.glob(f".{out.name}*")), field
    edges = lambda r: (r["perplexity"].update(ppl=ppl["ppl"] * (1 + 1e-8)),
                       task("zero_shot", "arc_easy", value=0.0, acc=0.0, acc_norm=0.0)(r),
                       task("zero_shot", "piqa", value=1.0, acc=1.0)(r),
                       task("generation", "humaneval", value=1.0, passed=24)(r), r["generation"].update(average=1.0))
    assert main(["card", str(out), "--eval", record_variant(good, tmp_path / "edges.json", edges)]) == 0
    assert "| humaneval pass@1 1.0000 |" in card(out).text
