"""Running out of GPU or host memory during ``recipe apply``: one line (exit code 4) naming the memory, where
the run was (step, pass, layer) and torch's own words; the run's resume checkpoints are kept, as the kernel's
OOM killer would leave them, and ``--resume`` finishes with the bytes of an uninterrupted run. The failed
allocations are injected: no test takes a machine's memory."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
import yaml

from recipe_engine.cli import main
from recipe_engine.execution.resume import resume_directory
from recipe_engine.modifiers.gptq import GPTQ
from recipe_engine.system.progress import Progress
from tests.helpers import save_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 40
GPU_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
               "1.20 GiB is free. If reserved but unallocated memory is large try setting "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
HOST_MESSAGE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                "tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)")


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory):
    base = tmp_path_factory.mktemp("oom")
    save_tiny_model(base / "model", num_hidden_layers=4)
    (base / "cal.txt").write_text(TEXT)
    recipe = {"version": 1, "name": "oom", "model": str(base / "model"), "output": str(base / "unused"),
              "dtype": "float32", "modifiers": ["FuseNorm", "GPTQ<group_size:32,export:compressed-tensors>"],
              "calibration": {"dataset": str(base / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2}}
    (base / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return base / "recipe.yaml"


def failing_at_layer(monkeypatch, layer: int, error: BaseException) -> None:
    """GPTQ's work on decoder layer ``layer`` raises ``error`` (an allocation that failed there)."""
    original = GPTQ.compress_layer

    def compress_layer(self, session, index, statistics):
        if index == layer:
            raise error
        return original(self, session, index, statistics)

    monkeypatch.setattr(GPTQ, "compress_layer", compress_layer)


def apply(recipe_file, output, *extra) -> int:
    return main(["apply", str(recipe_file), "--output", str(output), "--quiet", *extra])


@pytest.mark.parametrize("streamed", [False, True], ids=["memory", "streamed"])
def test_out_of_gpu_memory_is_one_line_and_resume_finishes_the_run(recipe_file, tmp_path, capsys, monkeypatch,
                                                                    streamed):
    mode = ["--set", "stream='on'"] if streamed else []
    assert apply(recipe_file, tmp_path / "reference", *mode) == 0
    capsys.readouterr()
    with monkeypatch.context() as patch:
        failing_at_layer(patch, 2, torch.OutOfMemoryError(GPU_MESSAGE))
        code = apply(recipe_file, tmp_path / "out", "--checkpoint-budget", "1", *mode)
    err = capsys.readouterr().err.strip()
    assert code == 4 and len(err.splitlines()) == 1, err
    assert err.startswith("error: out of GPU memory during [step 1: GPTQ] layer-sequential pass 3/4: CUDA out of "
                          "memory. Tried to allocate 2.00 GiB"), err
    assert "1.20 GiB is free; the resume checkpoints are kept: once memory is free, rerun with --resume" in err
    assert "expandable_segments:True" in err and "calibration.offload: true" in err
    assert not (tmp_path / "out").exists()
    assert (resume_directory(str(tmp_path / "out")) / "manifest.json").is_file()
    # memory freed: the same command with --resume goes on after layer 1 and writes the uninterrupted run's bytes
    assert apply(recipe_file, tmp_path / "out", "--checkpoint-budget", "1", "--resume", *mode) == 0
    assert sha256(tmp_path / "out" / "model.safetensors") == sha256(tmp_path / "reference" / "model.safetensors")
    assert not resume_directory(str(tmp_path / "out")).exists()
    resumed = json.loads((tmp_path / "out" / "report.json").read_text())["resumed"]
    assert resumed == {"group": 1, "layer": 1}  # GPTQ's pass, after its last finished layer


def test_out_of_host_memory_without_checkpoints_leaves_nothing(recipe_file, tmp_path, capsys, monkeypatch):
    """torch's host allocator raises a ``RuntimeError``; with ``--no-checkpoints`` there is nothing to resume."""
    failing_at_layer(monkeypatch, 1, RuntimeError(HOST_MESSAGE))
    code = apply(recipe_file, tmp_path / "out", "--no-checkpoints")
    err = capsys.readouterr().err.strip()
    assert code == 4 and len(err.splitlines()) == 1, err
    assert err.startswith("error: out of host memory during [step 1: GPTQ] layer-sequential pass 2/4: [enforce"), err
    assert "nothing was written; to need less: a smaller calibration.batch_size or stream: on" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_another_error_still_removes_the_checkpoints(recipe_file, tmp_path, monkeypatch):
    """Only a failed allocation keeps them: any other exception is a bug, a traceback, nothing left."""
    failing_at_layer(monkeypatch, 2, RuntimeError("something else"))
    with pytest.raises(RuntimeError, match="something else"):
        apply(recipe_file, tmp_path / "out", "--checkpoint-budget", "1")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_where_names_the_innermost_loop_an_error_left():
    progress = Progress(enabled=False)
    assert progress.where() is None
    progress.phase("step 0: GPTQ")
    with pytest.raises(ValueError):
        for layer in progress.track(range(5), "layer-sequential pass"):
            for batch in progress.track(range(3), "batches"):
                if (layer, batch) == (2, 1):
                    raise ValueError
    assert progress.where() == "[step 0: GPTQ] batches 2/3"
    for item in progress.track(range(4), "scores"):  # the run moved on
        assert progress.where() == f"[step 0: GPTQ] scores {item + 1}/4"
    assert progress.where() == "[step 0: GPTQ]"
    progress.phase("evaluating the model before compression")
    assert progress.where() == "[evaluating the model before compression]"


def test_out_of_gpu_memory_in_eval_is_one_line(recipe_file, tmp_path, capsys, monkeypatch):
    """Outside apply's run (``recipe eval``, ``bench``, ``export``) a failed allocation is one line too."""
    import recipe_engine.cli.evaluate as evaluate_command

    def evaluate_session(*_args, **_kwargs):
        raise torch.OutOfMemoryError(GPU_MESSAGE)

    monkeypatch.setattr(evaluate_command, "evaluate_session", evaluate_session)
    code = main(["eval", str(recipe_file.parent / "model"), "--seq-len", "32", "--limit", "1",
                 "--json", str(tmp_path / "eval.json")])
    err = capsys.readouterr().err.strip()
    assert code == 4 and err.splitlines()[-1] == (
        "error: out of GPU memory: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 1.20 GiB is free; nothing was written"), err
    assert not (tmp_path / "eval.json").exists()


def test_out_of_memory_while_evaluating_says_stream(recipe_file, tmp_path, capsys, monkeypatch):
    """An in-memory evaluation moves the whole model to the device: the advice is to stream it."""
    import recipe_engine.workflows.runner as runner

    def evaluate_session(*_args, **_kwargs):
        raise torch.OutOfMemoryError(GPU_MESSAGE)

    monkeypatch.setattr(runner, "evaluate_session", evaluate_session)
    code = apply(recipe_file, tmp_path / "out", "--set",
                 f"evaluate={{perplexity: {{dataset: {recipe_file.parent / 'cal.txt'}, seq_len: 32}}}}")
    err = capsys.readouterr().err.strip()
    assert code == 4 and len(err.splitlines()) == 1, err
    assert err.startswith("error: out of GPU memory during [evaluating the model before compression]: CUDA"), err
    assert err.endswith("nothing was written; to need less: stream: on (evaluates one layer at a time) or a "
                        "shorter evaluate.perplexity.seq_len"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
