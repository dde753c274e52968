"""SIGINT, SIGTERM and SIGHUP at several points of a run (loading, converting a GGUF, pass, writing): exit code
128+n, one line, nothing left beside the output, the conversion cache consistent. Real processes: one driver
(tests/signal_driver.py) imports the engine once and forks a child per case; the test signals each child
when it reaches its stall."""
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml

from recipe_engine.formats.gguf import source as gguf_source
from tests.helpers import BYTE_VOCAB, byte_tokenizer, start_signal_driver, tiny_model, write_tiny_gguf

POINTS = ("loading", "pass", "writing")
CASES = [(sig, point, "python") for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) for point in POINTS]
# the "SIGINT during a long solve takes ~23 s": a ~30 s native call is cut short by the watchdog
CASES += [(signal.SIGINT, "pass", "native")]


def case(tmp_path: Path, name: str, model: Path, point: str, stall: str, force: bool = False,
         cache: Path | None = None) -> dict:
    work = tmp_path / name
    work.mkdir(parents=True, exist_ok=True)
    (work / "cal.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    recipe = {"version": 1, "name": "sig", "model": str(model), "output": str(work / "out"),
              "calibration": {"dataset": str(work / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2},
              "modifiers": ["FuseNorm", "StallInPass"]}
    (work / "r.yaml").write_text(yaml.safe_dump(recipe))
    return {"name": name, "point": point, "stall": stall, "cwd": str(work),
            "argv": ["apply", str(work / "r.yaml"), "--quiet", "--device", "cpu"] + (["--force"] if force else []),
            "env": {"RECIPE_CACHE": str(cache)} if cache else {}}


def test_signals_at_every_point_leave_nothing(tmp_path, monkeypatch):
    model = tmp_path / "model"
    tiny_model(vocab_size=BYTE_VOCAB).save_pretrained(model, safe_serialization=True)
    byte_tokenizer().save_pretrained(model)
    signals, cases = {}, []
    for sig, point, stall in CASES:
        name = f"{sig.name}-{point}-{stall}"
        signals[name] = sig
        cases.append(case(tmp_path, name, model, point, stall))
    # --force over an earlier output, interrupted mid-write: the earlier output stays
    (tmp_path / "earlier" / "out").mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "data" / "report_format0" / "report.json", tmp_path / "earlier" / "out")
    (tmp_path / "earlier" / "out" / "recipe.yaml").write_text("earlier")
    cases.append(case(tmp_path, "earlier", model, "writing", "python", force=True))
    signals["earlier"] = signal.SIGTERM
    # a GGUF model interrupted while being converted into the cache
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", layers=4)
    cases.append(case(tmp_path, "converting", gguf, "converting", "python", cache=tmp_path / "cache"))
    signals["converting"] = signal.SIGTERM

    driver, base = start_signal_driver(tmp_path, cases)
    deadline, sent = time.monotonic() + 300, {}
    try:
        while len(sent) < len(cases):
            for name, sig in signals.items():
                if name in sent:
                    continue
                if (base / f"{name}.rc").exists():
                    pytest.fail(f"{name} ended before its stall: {(base / f'{name}.err').read_text()}")
                if (base / f"{name}.ready").exists():
                    work = tmp_path / name
                    if name.endswith("writing-python") or name == "earlier":
                        assert list(work.glob(".out.tmp-*/model.safetensors")), f"{name}: write not begun"
                    if name == "converting":
                        assert list((tmp_path / "cache" / "gguf").glob(".tiny-*.tmp-*")), "conversion not begun"
                    os.kill(int((base / f"{name}.pid").read_text()), sig)
                    sent[name] = time.monotonic()
            assert driver.poll() is None, driver.communicate()
            assert time.monotonic() < deadline, f"never reached the stall: {set(signals) - set(sent)}"
            time.sleep(0.05)
        driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    for name, sig in signals.items():
        err = (base / f"{name}.err").read_text()
        waited = (base / f"{name}.rc").stat().st_mtime - (time.time() - time.monotonic() + sent[name])
        assert int((base / f"{name}.rc").read_text()) == 128 + sig, (name, err)
        assert err.strip() == f"interrupted by {sig.name}; nothing written", (name, err)
        expected = sorted(["cal.txt", "r.yaml"] + (["out"] if name == "earlier" else []))
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == expected, name
        if name.endswith("native"):
            assert waited < 20, (name, waited)  # not the ~30 s the native call would have taken
    assert (tmp_path / "earlier" / "out" / "recipe.yaml").read_text() == "earlier"
    # the conversion cache holds neither a temporary nor a partial entry, and converts cleanly next time
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "cache"))
    converted = gguf_source.converted_gguf(gguf)
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [converted.name]
