"""Subprocess driver for tests/test_resume.py: runs ``recipe apply`` cases, SIGKILLs some at a pause point,
and resumes them.

``python tests/resume_driver.py CASES.json``

Imports torch, transformers and the engine once, then forks one child per run (each child runs the CLI's
``main`` with stderr in ``NAME.err`` and exits with its return code, written to ``NAME.rc``). A case is
``{"name", "argv", "pause", "then"}``: with ``pause`` (``step``, ``pass`` or ``writing``) the child stops
there (``NAME.ready`` appears), the driver SIGKILLs it, records what it left (``NAME.checkpoint.json``), then
runs ``then`` (a list of cases, e.g. the ``--resume`` run; ``touch``: a file whose modification time is changed
first) in order. ``env``: environment of the child (``RECIPE_TEST_AUTO_STREAMS=yes|no`` fixes what
``stream: auto`` decides). A resumed child records what restoring left in memory (``NAME.restored.json``). The
pause points are two test steps in the recipes, active only when the child's ``RECIPE_TEST_PAUSE`` names them:
``PauseStep`` (model-scope, between steps) and ``PauseInPass`` (inside a shared pass, in ``compress_layer`` of
layer 2, after layers 0-1 are finished; with ``out of memory on rank R`` it raises torch's ``OutOfMemoryError``
there instead, on rank R of a data-parallel run), plus ``writing`` (``save_pretrained`` or the engine's
``write_checkpoint`` has written the checkpoint files into the temporary output directory). Independent cases
run two at a time.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import transformers

from recipe_engine.execution import resume
from recipe_engine.plan import preflight
from recipe_engine.workflows import runner
from recipe_engine.cli import main as cli_main
from recipe_engine.recipe.modifier import LayerModifier, Modifier
from recipe_engine.recipe.registry import REGISTRY


def pause(ready: Path) -> None:
    ready.touch()
    time.sleep(120)
    raise SystemExit("pause ended without SIGKILL")


class PauseStep(Modifier):
    """Pauses when RECIPE_TEST_PAUSE is ``step``; otherwise changes nothing."""

    changes_weights = False
    preserves_outputs = True  # the FlattenAdjacent pass after it keeps the reference's states for NystromMLP

    def apply(self, session):
        if os.environ.get("RECIPE_TEST_PAUSE") == "step":
            pause(Path(os.environ["RECIPE_TEST_READY"]))
        return {}


class PauseInPass(LayerModifier):
    """Pauses in ``compress_layer`` of layer 2 when RECIPE_TEST_PAUSE is ``pass``; changes nothing."""

    modifies = ()

    def target_layers(self, session):
        return list(range(len(session.layers)))

    def compress_layer(self, session, layer_index, stats):
        if os.environ.get("RECIPE_TEST_PAUSE") == "pass" and layer_index == 2:
            pause(Path(os.environ["RECIPE_TEST_READY"]))
        if os.environ.get("RECIPE_TEST_PAUSE") == f"out of memory on rank {os.environ.get('RANK', '0')}" \
                and layer_index == 2:  # a failed GPU allocation there (no pause: the run ends by itself)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return {}


def install() -> None:
    REGISTRY.load()
    REGISTRY._classes.update(PauseStep=PauseStep, PauseInPass=PauseInPass)
    save = transformers.PreTrainedModel.save_pretrained

    def save_pretrained(self, directory, **kwargs):
        save(self, directory, **kwargs)
        if os.environ.get("RECIPE_TEST_PAUSE") == "writing":
            pause(Path(os.environ["RECIPE_TEST_READY"]))

    transformers.PreTrainedModel.save_pretrained = save_pretrained
    write = runner.write_checkpoint  # the engine's writer (packed quantized or streamed models)

    def write_checkpoint(session, directory, *args, **kwargs):
        write(session, directory, *args, **kwargs)
        if os.environ.get("RECIPE_TEST_PAUSE") == "writing":
            pause(Path(os.environ["RECIPE_TEST_READY"]))

    runner.write_checkpoint = write_checkpoint
    restore = resume.Checkpoints.restore

    def restore_and_record(self, session, report):  # what restoring left in memory (streamed: nothing)
        restore(self, session, report)
        if self.manifest is not None and "RECIPE_TEST_RESTORED" in os.environ:
            materialized = sum(p.device.type != "meta" for p in session.model.parameters())
            Path(os.environ["RECIPE_TEST_RESTORED"]).write_text(json.dumps(
                {"streamed": session.stream is not None, "materialized": materialized}))

    resume.Checkpoints.restore = restore_and_record
    exceeds = preflight.exceeds_memory

    def exceeds_memory(spec):  # what ``stream: auto`` decides, fixed by a case's RECIPE_TEST_AUTO_STREAMS
        fixed = os.environ.get("RECIPE_TEST_AUTO_STREAMS")
        return exceeds(spec) if fixed is None else fixed == "yes"

    preflight.exceeds_memory = exceeds_memory  # ``decide_streaming`` asks it


def record_checkpoint(case: dict, base: Path) -> None:
    """``NAME.checkpoint.json``: what a killed run left: the manifest's units, the unit files on disk and any
    staging directory inside its temporary output directory."""
    output = Path(case["argv"][case["argv"].index("--output") + 1])
    directory = resume.resume_directory(str(output))
    staging = [str(p) for p in output.parent.glob(f".{output.name}.tmp-*/.staging")]
    if not (directory / resume.MANIFEST).is_file():  # e.g. --no-checkpoints
        (base / f"{case['name']}.checkpoint.json").write_text(json.dumps({
            "resume_directory": directory.exists(), "staging_in_output": staging}))
        return
    manifest = json.loads((directory / resume.MANIFEST).read_text())
    (base / f"{case['name']}.checkpoint.json").write_text(json.dumps({
        "layers": manifest["layers"], "rest": manifest["rest"],
        "unit_files": sorted(p.name for p in directory.glob("unit-*")),
        "staging_in_output": staging}))


def run(case: dict, base: Path, paused: bool) -> int:
    ready = base / f"{case['name']}.ready"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            err = os.open(base / f"{case['name']}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(err, 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            sys.stderr = open(2, "w", closefd=False)
            os.environ.pop("RECIPE_TEST_PAUSE", None)
            os.environ.update(case.get("env", {}), RECIPE_TEST_RESTORED=str(base / f"{case['name']}.restored.json"))
            if paused:
                os.environ.update(RECIPE_TEST_PAUSE=case["pause"], RECIPE_TEST_READY=str(ready))
            code = cli_main(case["argv"])
        finally:
            sys.stderr.flush()
            os._exit(code)
    if paused:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            finished, _ = os.waitpid(pid, os.WNOHANG)
            if finished:
                raise SystemExit(f"{case['name']} ended before its pause point: see {case['name']}.err")
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if paused:
        record_checkpoint(case, base)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    (base / f"{case['name']}.rc").write_text(str(code))
    return code


def run_chain(case: dict, base: Path) -> None:
    """A case, then its ``then`` runs in order."""
    run(case, base, paused=bool(case.get("pause")))
    for follow in case.get("then", []):
        if follow.get("touch"):  # a changed source: a newer modification time
            os.utime(follow["touch"], ns=(time.time_ns(), time.time_ns() + 10**9))
        run(follow, base, paused=False)


def run_chains(chains: list[dict], base: Path, workers: int) -> None:
    """Each chain in a forked worker, at most ``workers`` at once (chains write disjoint outputs)."""
    running: dict[int, str] = {}
    failed = []

    def reap() -> None:
        pid, status = os.wait()
        if status != 0:
            failed.append(running[pid])
        del running[pid]

    for case in chains:
        if len(running) >= workers:
            reap()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                run_chain(case, base)
                code = 0
            finally:
                os._exit(code)
        running[pid] = case["name"]
    while running:
        reap()
    if failed:
        raise SystemExit(f"driver failed in the chains of {failed}")


def main() -> int:
    """Chains run two at a time (one torch thread each); a chain that touches a source file runs after the
    others, alone, since a changed modification time would make a concurrent ``--resume`` refuse."""
    cases_file = Path(sys.argv[1])
    base = cases_file.parent
    torch.set_num_threads(1)
    install()
    chains = json.loads(cases_file.read_text())
    touching = [case for case in chains if any(follow.get("touch") for follow in case.get("then", []))]
    run_chains([case for case in chains if case not in touching], base, workers=2)
    run_chains(touching, base, workers=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
