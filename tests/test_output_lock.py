"""One writer per output: a second run aimed at a live run's output is refused in one line naming the live
process, whose temporary files and resume checkpoints stay untouched; the lock of a killed run (or a killed
``recipe export``) is taken over and removed.

Real processes: the live run is a child of tests/signal_driver.py stalled inside its layer pass (its
``.out.resume`` checkpoints exist by then); the second run is this test process calling the CLI's ``main``.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recipe_engine.cli import main
from recipe_engine.recipe.modifier import LayerModifier
from recipe_engine.paths.lock import lock_path, output_lock
from recipe_engine.recipe.registry import REGISTRY
from tests.helpers import start_signal_driver

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


class StallInPass(LayerModifier):
    """The driver's step of the same name, here without a stall (it changes nothing)."""

    def target_layers(self, session):
        return list(range(len(session.layers)))

    def compress_layer(self, session, layer_index, stats):
        return {}


@pytest.fixture
def stall_step(monkeypatch):
    monkeypatch.setitem(REGISTRY._classes, "StallInPass", StallInPass)


def work_dir(tmp_path: Path, model: Path, name: str = "work", evaluate: bool = False) -> Path:
    work = tmp_path / name
    work.mkdir()
    (work / "cal.txt").write_text(TEXT)
    recipe = {"version": 1, "name": "lock", "model": str(model), "output": str(work / "out"),
              "calibration": {"dataset": str(work / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2},
              "modifiers": ["FuseNorm", "StallInPass"]}
    if evaluate:
        recipe["evaluate"] = {"perplexity": {"dataset": [str(work / "cal.txt")], "seq_len": 32, "split": "all"}}
    (work / "r.yaml").write_text(yaml.safe_dump(recipe))
    return work


def wait_ready(driver: subprocess.Popen, base: Path, name: str) -> int:
    deadline = time.monotonic() + 240
    while not (base / f"{name}.ready").exists():
        assert not (base / f"{name}.rc").exists(), (base / f"{name}.err").read_text()
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline, "the run never reached its stall"
        time.sleep(0.05)
    return int((base / f"{name}.pid").read_text())


def finish(driver: subprocess.Popen, base: Path, name: str) -> tuple[int, str]:
    try:
        driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    return int((base / f"{name}.rc").read_text()), (base / f"{name}.err").read_text()


def listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def one_line(capsys, argv, code=2) -> str:
    got = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert got == code, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_second_run_on_a_live_output_is_refused_and_leaves_its_checkpoints(tmp_path, model_dir, capsys,
                                                                           stall_step):
    work = work_dir(tmp_path, model_dir)
    argv = ["apply", str(work / "r.yaml"), "--quiet", "--device", "cpu"]
    driver, base = start_signal_driver(tmp_path, [{"name": "first", "point": "pass", "stall": "python",
                                            "cwd": str(work), "argv": argv, "env": {}}])
    try:
        pid = wait_ready(driver, base, "first")
        live = listing(work)
        assert ".out.resume" in live and ".out.lock" in live and any(n.startswith(".out.tmp-") for n in live), live
        checkpoint_files = listing(work / ".out.resume")
        for extra in ([], ["--force"], ["--resume"]):  # none of them may touch the live run's files
            err = one_line(capsys, argv + extra)
            assert f"field 'output': output '{work / 'out'}' is being written by another run (pid {pid} on " in err
            assert listing(work) == live and listing(work / ".out.resume") == checkpoint_files
        # the same output reached through a symbolic link is the same lock
        (tmp_path / "alias").symlink_to(work)
        one_line(capsys, argv + ["--output", str(tmp_path / "alias" / "out")])
        os.kill(pid, signal.SIGTERM)
        code, err = finish(driver, base, "first")
    finally:
        if driver.poll() is None:
            driver.kill()
    assert code == 128 + signal.SIGTERM and err.strip() == "interrupted by SIGTERM; nothing written", err
    assert listing(work) == ["cal.txt", "r.yaml"]  # the lock file went with the run


@pytest.fixture(scope="module")
def signalled(tmp_path_factory, model_dir):
    """Three runs in one driver (its imports paid once): ``killed`` gets SIGKILL inside its layer pass,
    ``eval`` SIGTERM inside the dense model's perplexity (progress bars on), ``export`` (``recipe export`` of a
    GGUF-exportable model to ``out/m.gguf``) SIGKILL while it writes the tensors. Returns
    ``{name: (work directory, exit code, stderr)}``."""
    from tests.test_gguf_export import saved

    root = tmp_path_factory.mktemp("signalled")
    works = {"killed": work_dir(root, model_dir, "killed"), "eval": work_dir(root, model_dir, "eval", evaluate=True),
             "export": root / "export"}
    saved(works["export"])  # export/model, with a BPE vocabulary (GGUF export refuses the byte tokenizer)
    cases = [{"name": "killed", "point": "pass", "stall": "python", "cwd": str(works["killed"]),
              "argv": ["apply", str(works["killed"] / "r.yaml"), "--quiet", "--device", "cpu"], "env": {}},
             {"name": "eval", "point": "evaluating", "stall": "python", "cwd": str(works["eval"]),
              "argv": ["apply", str(works["eval"] / "r.yaml"), "--device", "cpu"], "env": {}},
             {"name": "export", "point": "exporting", "stall": "python", "cwd": str(works["export"]), "env": {},
              "argv": ["export", "model", "--format", "gguf", "--output", "out/m.gguf"]}]
    driver, base = start_signal_driver(root, cases)
    try:
        for name, sig in (("killed", signal.SIGKILL), ("eval", signal.SIGTERM), ("export", signal.SIGKILL)):
            os.kill(wait_ready(driver, base, name), sig)
        driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    return {name: (work, int((base / f"{name}.rc").read_text()), (base / f"{name}.err").read_text())
            for name, work in works.items()}


def test_lock_of_a_killed_run_is_taken_over(signalled, capsys, stall_step):
    work, code, _ = signalled["killed"]
    assert code == -signal.SIGKILL
    left = listing(work)
    assert ".out.lock" in left and ".out.resume" in left, left  # what SIGKILL leaves
    assert main(["apply", str(work / "r.yaml"), "--quiet", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "removing the checkpoints of an interrupted run" in err and "left by an interrupted run" in err
    assert listing(work) == ["cal.txt", "out", "r.yaml"]


def test_lock_of_a_killed_export_is_taken_over(signalled, capsys):
    """SIGKILL inside a GGUF export leaves its lock file and its temporary beside the target (a killed process
    removes nothing; the kernel released its flock); the next export of that target is not blocked: it takes
    the lock over, removes the temporary, writes the bytes of an export never interrupted, and leaves no lock."""
    work, code, _ = signalled["export"]
    assert code == -signal.SIGKILL
    target = work / "out" / "m.gguf"
    left = listing(target.parent)
    assert len(left) == 2 and left[0] == ".m.gguf.lock" and left[1].startswith(".m.gguf.tmp-"), left
    capsys.readouterr()
    assert main(["export", str(work / "model"), "--format", "gguf", "--output", str(target)]) == 0
    err = capsys.readouterr().err
    assert f"note: removed {target.parent / left[1]}, left by an interrupted export" in err, err
    assert listing(target.parent) == ["m.gguf"]
    reference = work / "reference" / "m.gguf"  # an export never interrupted
    assert main(["export", str(work / "model"), "--format", "gguf", "--output", str(reference)]) == 0
    assert target.read_bytes() == reference.read_bytes() and listing(reference.parent) == ["m.gguf"]


def test_sigterm_during_evaluation_is_one_line(signalled):
    """The progress bar's generator, closed after its display ended, leaves no "Exception ignored" traceback."""
    work, code, err = signalled["eval"]
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted by SIGTERM; nothing written", err
    assert listing(work) == ["cal.txt", "r.yaml"]


@pytest.mark.parametrize("terminal", [True, False])  # rich bars, plain lines
def test_progress_generator_closed_after_the_display(capsys, terminal):
    import gc
    import io

    from rich.console import Console

    from recipe_engine.system.progress import Progress

    unraisable = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with Progress(console=Console(file=io.StringIO(), force_terminal=terminal)) as bar:
            rows = bar.track(range(3), "rows")
            next(rows)
        del rows
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraisable == []


@pytest.mark.parametrize("command", ["export", "sweep"])
def test_export_and_sweep_outputs_are_locked_too(tmp_path, model_dir, capsys, command):
    target = tmp_path / ("m.gguf" if command == "export" else "sweep")
    (tmp_path / "cal.txt").write_text(TEXT)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"version": 1, "name": "s", "model": str(model_dir), "output": "unused",
                                      "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4,
                                                      "seq_len": 32},
                                      "modifiers": [{"ShortGPT": {"n": 1}}],
                                      "evaluate": {"perplexity": {"dataset": [str(tmp_path / "cal.txt")],
                                                                  "seq_len": 32, "split": "all"}}}))
    argv = (["export", str(model_dir), "--format", "gguf", "--output", str(target)] if command == "export" else
            ["sweep", str(recipe), "--vary", "n=1", "--output", str(target), "--quiet"])
    with output_lock(target):  # held by this process: a second open of the lock file is refused like another's
        err = one_line(capsys, argv)
    assert f"is being written by another run (pid {os.getpid()} on " in err
    assert listing(tmp_path) == ["cal.txt", "r.yaml"]
    assert not lock_path(target).exists()
