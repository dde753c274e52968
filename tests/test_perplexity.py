"""Perplexity protocol: hand-computed NLL reference, windowing edge cases, limit."""
import math

import pytest
import torch

from recipe_engine.io.data import load_text, wikitext_rows
from recipe_engine.errors import SourceError
from recipe_engine.evaluation import perplexity
from tests.helpers import CharTokenizer, shared_data, tiny_model

SEQ = 16
TEXT = "The quick brown fox jumps over the lazy dog. " * 2  # 90 bytes = 5 windows of 16 + a 10-token tail


def hand_nll(model, ids: list[int], seq_len: int, windows: int) -> tuple[float, int]:
    """Sum of -log p(token_t | tokens_<t within its window) by explicit loops; first token of each window skipped."""
    total, count = 0.0, 0
    for w in range(windows):
        window = ids[w * seq_len:(w + 1) * seq_len]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([window])).logits[0].double()
        for t in range(1, seq_len):
            row = logits[t - 1]
            total -= float(row[window[t]] - torch.logsumexp(row, dim=0))
            count += 1
    return total, count


def test_ppl_equals_hand_computed_nll():
    model, tok = tiny_model(), CharTokenizer()
    ids = tok(TEXT)["input_ids"]
    result = perplexity(model, tok, TEXT, seq_len=SEQ, limit=None)
    total, count = hand_nll(model, ids, SEQ, windows=5)
    assert result["windows"] == result["windows_available"] == 5
    assert result["tokens"] == count == 5 * (SEQ - 1)
    assert result["nll"] == pytest.approx(total / count, rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_tail_shorter_than_a_window_is_dropped():
    model, tok = tiny_model(), CharTokenizer()
    full = perplexity(model, tok, TEXT, seq_len=SEQ, limit=None)
    other_tail = perplexity(model, tok, TEXT[:80] + "0123456789", seq_len=SEQ, limit=None)
    assert other_tail["ppl"] == full["ppl"]
    assert other_tail["fingerprint"] == full["fingerprint"]
    changed_window = perplexity(model, tok, "X" + TEXT[1:], seq_len=SEQ, limit=None)
    assert changed_window["fingerprint"] != full["fingerprint"]


def test_limit_evaluates_first_windows_only():
    model, tok = tiny_model(), CharTokenizer()
    ids = tok(TEXT)["input_ids"]
    result = perplexity(model, tok, TEXT, seq_len=SEQ, limit=2)
    total, count = hand_nll(model, ids, SEQ, windows=2)
    assert (result["windows"], result["windows_available"], result["tokens"]) == (2, 5, 2 * (SEQ - 1))
    assert result["nll"] == pytest.approx(total / count, rel=1e-5)
    assert perplexity(model, tok, TEXT, seq_len=SEQ, limit=99)["windows"] == 5


def test_text_shorter_than_one_window_is_an_error():
    with pytest.raises(SourceError, match="shorter than one window of 16"):
        perplexity(tiny_model(), CharTokenizer(), "too short", seq_len=SEQ, limit=None, source="short.txt")


def test_local_text_file_source(tmp_path):
    path = tmp_path / "eval.txt"
    path.write_text(TEXT)
    source = load_text(str(path), "test")
    assert source.text == TEXT and source.origin == str(path)


@pytest.mark.skipif(not (shared_data() / "wikitext-2-raw" / "wiki.test.raw").is_file(),
                    reason="needs shared/data/wikitext-2-raw")
def test_wikitext2_text_is_hf_rows_joined_by_blank_lines():
    raw = (shared_data() / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    text = load_text("wikitext2", "test").text
    rows = wikitext_rows(raw)
    assert len(rows) == 4358 and rows[0] == "" and rows[1] == " = Robert Boulter = \n"
    assert text == "\n\n".join(rows)
    assert text.startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert Boulter is an English film")
