"""Progress without a terminal: `recipe apply`, `eval` and `export` piped to a file write plain lines (step,
k/N, elapsed, time left) at most one per interval, and no control characters; in a terminal, rich bars."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from recipe_engine.system.progress import Progress, duration

ROOT = Path(__file__).resolve().parents[1]
TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 80
LINE = r"^\[(?P<phase>[^\]]+)\] (?P<what>.+) (?P<done>\d+)/(?P<total>\d+), elapsed \S+, ~\S+ left$"


def piped(args, interval="0", **env):
    """Run ``recipe ARGS`` with stdout and stderr into one file (no terminal); returns the log."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "RECIPE_PROGRESS_INTERVAL": interval, **env}
    environment.pop("FORCE_COLOR", None)
    run = subprocess.run([sys.executable, "-m", "recipe_engine.cli", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=environment, timeout=600)
    log = run.stdout.decode()
    assert run.returncode == 0, log
    return log


@pytest.fixture(scope="module")
def applied(tmp_path_factory, model_dir):
    base = tmp_path_factory.mktemp("progress")
    (base / "cal.txt").write_text(TEXT)
    recipe = {"version": 1, "name": "progress", "model": str(model_dir), "device": "cpu", "output": str(base / "out"),
              "modifiers": ["ShortGPT<n:1>", "GPTQ<group_size:32>"],
              "evaluate": {"perplexity": {"dataset": str(base / "cal.txt"), "seq_len": 32, "limit": 3}},
              "calibration": {"dataset": str(base / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2}}
    (base / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return base, piped(["apply", str(base / "r.yaml")])


def test_piped_apply_writes_plain_progress_lines_and_no_control_characters(applied):
    import re

    _, log = applied
    assert "\x1b" not in log and "\r" not in log
    lines = [m.groupdict() for m in map(re.compile(LINE).match, log.splitlines()) if m]
    assert any(line["phase"] == "step 1: GPTQ" and line["what"] == "layer-sequential pass" and line["total"] == "3"
               for line in lines), log  # GPTQ over the 3 layers ShortGPT left
    assert any(line["phase"].startswith("evaluating") and line["what"] == "perplexity windows" for line in lines)
    assert all(1 <= int(line["done"]) <= int(line["total"]) for line in lines)
    assert "step 0: ShortGPT" in log.splitlines()  # each step named on its own line


def test_piped_eval_writes_plain_lines(applied):
    base, _ = applied
    arguments = ["eval", str(base / "out"), "--dataset", str(base / "cal.txt"), "--seq-len", "16", "--limit", "6",
                 "--device", "cpu"]
    log = piped(arguments)
    assert "\x1b" not in log and "\r" not in log
    assert "perplexity windows 6/6, elapsed " in log
    assert " left" not in piped(arguments, interval="3600")  # a command shorter than the interval: no line


def test_plain_lines_come_at_most_once_per_interval(monkeypatch):
    from recipe_engine.system import progress

    clock = iter(range(0, 1000, 4))  # every item takes 4 s
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    with Progress(console=Console(file=log, force_terminal=False), interval=10) as bar:
        bar.phase("step 0: X")
        assert list(bar.track(range(10), "layers")) == list(range(10))
    # made at 0 s, the loop starts at 4 s; item k ends at 4 + 4k s: lines at 12, 24 and 36 s (items 2, 5, 8)
    assert log.getvalue().splitlines() == ["step 0: X", "[step 0: X] layers 2/10, elapsed 8s, ~32s left",
                                           "[step 0: X] layers 5/10, elapsed 20s, ~20s left",
                                           "[step 0: X] layers 8/10, elapsed 32s, ~8s left"]


def test_piped_export_writes_plain_lines(tmp_path):
    from tests.test_gguf_export import saved

    _, directory = saved(tmp_path)  # a tokenizer with merges, as llama.cpp needs
    log = piped(["export", str(directory), "--format", "gguf", "--output", str(tmp_path / "m.gguf"), "--type", "f32"])
    assert "\x1b" not in log and "\r" not in log
    assert "GGUF tensors written 1/" in log and "wrote " in log


def test_a_terminal_gets_rich_bars_and_a_pipe_none():
    terminal, pipe = io.StringIO(), io.StringIO()
    for stream, force in ((terminal, True), (pipe, False)):
        with Progress(console=Console(file=stream, force_terminal=force, width=80), interval=0) as bar:
            assert list(bar.track(range(3), "rows")) == [0, 1, 2]
    assert "\x1b" in terminal.getvalue()  # rich's live display
    assert pipe.getvalue().splitlines() == ["rows 1/3, elapsed 0s, ~0s left", "rows 2/3, elapsed 0s, ~0s left",
                                            "rows 3/3, elapsed 0s, ~0s left"]


def test_duration_reads_as_seconds_minutes_hours():
    assert [duration(s) for s in (4.4, 59.6, 307, 7380)] == ["4s", "1m00s", "5m07s", "2h03m"]
