"""Perplexity protocol: hand-computed NLL reference, windowing edge cases, limit."""
import math

import pytest
import torch

from recipe_engine.sources.text import load_text, wikitext_rows
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


PEAK_SCRIPT = """
import sys, torch
from tests.helpers import tiny_model
from recipe_engine.evaluation.perplexity import window_nll
from recipe_engine.system.host_memory import PeakWatch, current_rss
torch.set_num_threads(1)
for name in ("float32", "bfloat16"):
    model = tiny_model("llama", vocab_size=65536, num_hidden_layers=1).to(getattr(torch, name))
    ids = torch.randint(0, 65536, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        window_nll(model, ids[:, :16], torch.device("cpu"))  # allocator and kernels warmed up
        watch = PeakWatch(); watch.start(); base = current_rss()
        window_nll(model, ids, torch.device("cpu"))
    print(name, watch.stop() - base)
"""


def test_the_plans_evaluation_term_is_a_windows_measured_peak():
    """``recipe plan`` counts one perplexity window as ``seq_len × vocab × 8`` bytes; a fresh process's resident
    peak (``VmHWM``, reset before the window) rises by that much, fp32 and bf16, within 10 %."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from recipe_engine.architectures.shape import ModelShape
    from recipe_engine.plan.estimates import evaluation_logits_bytes
    from recipe_engine.recipe.schema import recipe_from_dict

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert run.returncode == 0, run.stderr
    for line in run.stdout.split("\n"):
        if not line.strip():
            continue
        name, measured = line.split()
        recipe = recipe_from_dict({"version": 1, "name": "p", "model": "m", "output": "o", "dtype": name,
                                   "modifiers": ["FuseNorm"], "evaluate": {"perplexity": {"seq_len": 512}}})
        shape = ModelShape.from_config(tiny_model("llama", vocab_size=65536, num_hidden_layers=1).config)
        estimate = evaluation_logits_bytes(recipe, shape)  # in memory: one window at a time
        assert 0.9 * estimate <= int(measured) <= 1.1 * estimate, (name, measured, estimate)


NLL_PEAK_SCRIPT = """
import torch
from tests.baselines_helpers import make_session
from tests.helpers import tiny_model
from recipe_engine.system.host_memory import PeakWatch, current_rss
torch.set_num_threads(1)
for name in ("float32", "bfloat16"):
    model = tiny_model("llama", vocab_size=65536, num_hidden_layers=1).to(getattr(torch, name))
    tokens = torch.randint(0, 65536, (4, 256), generator=torch.Generator().manual_seed(0))
    session = make_session(model, tokens, batch_size=4)
    finals = session.capture_inputs()  # the last layer's inputs stand in for its outputs: same shapes
    session.session.pipeline.final_nll(finals)  # allocator warmed up
    watch = PeakWatch(); watch.start(); base = current_rss()
    session.session.pipeline.final_nll(finals)
    print(name, watch.stop() - base)
"""


def test_a_calibration_nlls_estimate_is_its_measured_peak():
    """``calibration_nll_bytes`` (a batch's logits in the model dtype, one window's in fp32 and its
    log-softmax) against a fresh process's rise of its resident peak over ``final_nll`` of a batch of 4
    windows, fp32 and bf16, within 10 % (``final_nll`` takes one window at a time past the lm_head: a whole
    batch in fp32 and log-softmax was 2.5x this in bf16)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from recipe_engine.architectures.shape import ModelShape
    from recipe_engine.recipe.modifier import calibration_nll_bytes

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", NLL_PEAK_SCRIPT], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert run.returncode == 0, run.stderr
    for line in filter(str.strip, run.stdout.split("\n")):
        name, measured = line.split()
        shape = ModelShape.from_config(tiny_model("llama", vocab_size=65536, num_hidden_layers=1).config)
        shape.dtype_bytes, shape.calibration_batch = (4 if name == "float32" else 2), 4
        estimate = calibration_nll_bytes(shape, 4, 256)
        assert 0.9 * estimate <= int(measured) <= 1.1 * estimate, (name, measured, estimate)
