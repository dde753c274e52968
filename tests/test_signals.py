"""SIGINT, SIGTERM and SIGHUP at three points of a run (loading, pass, writing): exit code 128+n, one line,
nothing left beside the output. Subprocesses (tests/signal_driver.py) on a tiny random model, all started
at once: the cost is one torch import per case (~15 s in all on two idle cores)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recipe_engine import models
from tests.helpers import BYTE_VOCAB, byte_tokenizer, tiny_model, write_tiny_gguf

DRIVER = Path(__file__).with_name("signal_driver.py")
ROOT = DRIVER.parents[1]
POINTS = ("loading", "pass", "writing")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model(vocab_size=BYTE_VOCAB).save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return path


def start(workdir: Path, model_dir: Path, point: str, stall: str, force_over: bool = False, cache=None):
    """Start the driver in ``workdir``; returns (process, ready file, output path)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "cal.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    recipe = {"version": 1, "name": "sig", "model": str(model_dir), "output": str(workdir / "out"),
              "calibration": {"dataset": str(workdir / "cal.txt"), "samples": 4, "seq_len": 32,
                              "batch_size": 2},
              "modifiers": ["FuseNorm", "StallInPass"]}
    (workdir / "r.yaml").write_text(yaml.safe_dump(recipe))
    ready = workdir.parent / f"{workdir.name}.ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **({"RECIPE_CACHE": str(cache)} if cache else {})}
    args = [sys.executable, str(DRIVER), point, stall, str(ready), "--", "apply", str(workdir / "r.yaml"),
            "--quiet", "--device", "cpu"] + (["--force"] if force_over else [])
    proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    return proc, ready, workdir / "out"


CASES = [(sig, point, "python") for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) for point in POINTS]
# the "SIGINT during a long solve takes ~23 s": a ~30 s native call is cut short by the watchdog
CASES += [(signal.SIGINT, "pass", "native")]


def test_signals_at_every_point_leave_nothing(tmp_path, model_dir, monkeypatch):
    """All cases run concurrently (one torch import each is the cost); each is signalled as soon as it
    reaches its stall, and must exit with 128+n within the watchdog's grace, printing one line, with
    nothing left beside the output (the ``writing`` cases had their temporary directory populated)."""
    runs = {}
    for sig, point, stall in CASES:
        name = f"{sig.name}-{point}-{stall}"
        runs[name] = (sig, point, *start(tmp_path / name, model_dir, point, stall))
    (tmp_path / "earlier" / "out").mkdir(parents=True)  # --force over an earlier output, killed mid-write
    (tmp_path / "earlier" / "out" / "report.json").write_text('{"recipe": {}}')
    (tmp_path / "earlier" / "out" / "recipe.yaml").write_text("earlier")
    runs["earlier"] = (signal.SIGTERM, "writing",
                       *start(tmp_path / "earlier", model_dir, "writing", "python", force_over=True))
    # a GGUF model interrupted while being converted into the cache
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", layers=4)
    runs["converting"] = (signal.SIGTERM, "converting",
                          *start(tmp_path / "converting", gguf, "converting", "python", cache=tmp_path / "cache"))
    deadline, sent = time.monotonic() + 300, {}
    while len(sent) < len(runs):
        for name, (sig, point, proc, ready, out) in runs.items():
            if name in sent:
                continue
            if proc.poll() is not None:
                pytest.fail(f"{name}: driver ended before the stall: {proc.communicate()}")
            if ready.exists():
                if point == "writing":
                    assert list(out.parent.glob(".out.tmp-*/model.safetensors")), f"{name}: write not begun"
                if point == "converting":
                    assert list((tmp_path / "cache" / "gguf").glob(".tiny-*.tmp-*")), "conversion not begun"
                proc.send_signal(sig)
                sent[name] = time.monotonic()
        assert time.monotonic() < deadline, f"never reached the stall: {set(runs) - set(sent)}"
        time.sleep(0.05)
    for name, (sig, point, proc, ready, out) in runs.items():
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{name}: no exit within 60 s of {sig.name}")
        waited = time.monotonic() - sent[name]
        assert proc.returncode == 128 + sig, (name, err)
        assert err.strip() == f"interrupted by {sig.name}; nothing written", (name, err)
        expected = sorted(["cal.txt", "r.yaml"] + (["out"] if name == "earlier" else []))
        assert sorted(p.name for p in out.parent.iterdir()) == expected, name
        if name.endswith("native"):
            assert waited < 20, (name, waited)  # not the ~30 s the native call would have taken
    assert (tmp_path / "earlier" / "out" / "recipe.yaml").read_text() == "earlier"
    # the conversion cache holds neither a temporary nor a partial entry, and converts cleanly next time
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "cache"))
    converted = models.converted_gguf(gguf)
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [converted.name]
