"""Subprocess driver for tests/test_signals.py: runs CLI cases (``recipe apply``, ``recipe export``) that stall at
one point each.

``python tests/signal_driver.py CASES.json``

The driver imports torch, transformers and the engine once, then forks one child per case (so the cost of
the imports is paid once, not per case). Each case is ``{"name", "point", "stall", "cwd", "argv", "env"}``;
the child writes ``NAME.pid`` beside CASES.json, redirects its stderr to ``NAME.err``, applies the stall for
its point, and runs the CLI's ``main`` (exiting with its return code, as the ``recipe`` script does). The
driver writes each child's exit code to ``NAME.rc``.

POINT is where the run stalls: ``loading`` (before the weights are read), ``converting`` (a GGUF model
being dequantized into the cache, after the tokenizer was saved there), ``pass`` (inside the shared
layer-sequential pass, in a layer step's ``compress_layer``), ``evaluating`` (in the perplexity of the
``evaluate:`` block, with its progress bar running), ``writing`` (after the checkpoint files are
written into the temporary output directory, before the rename) or ``exporting`` (a ``recipe export`` to GGUF,
at its first tensor: the header is in its temporary file). STALL is ``python`` (an interruptible
``time.sleep``) or ``native`` (one long torch call that does not return to Python for ~30 s, like a large
solve). ``NAME.ready`` is created when the stall begins, so the test knows when to send its signal.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers

from recipe_engine.workflows import runner
from recipe_engine.cli import main as cli_main
from recipe_engine.recipe.modifier import LayerModifier
from recipe_engine.recipe.registry import REGISTRY


def stall(kind: str, ready: Path) -> None:
    if kind == "native":
        a = torch.randn(768, 768) / 768 ** 0.5
        start = time.perf_counter()
        torch.linalg.multi_dot([a, a, a])
        per_product = max((time.perf_counter() - start) / 2, 1e-4)
        chain = [a] * max(3, int(30 / per_product))
        ready.touch()
        torch.linalg.multi_dot(chain)  # one ATen call: Python signal handlers wait until it returns
    else:
        ready.touch()
        time.sleep(60)
    raise SystemExit("stall ended without a signal")


def install(point: str, kind: str, ready: Path) -> None:
    """Patch the engine so that the run stalls at ``point``."""
    if point == "loading":
        original = runner.load_model

        def load_model(*args, **kwargs):
            stall(kind, ready)
            return original(*args, **kwargs)

        runner.load_model = load_model
    elif point == "converting":
        load = transformers.AutoModelForCausalLM.from_pretrained

        def from_pretrained(*args, **kwargs):
            model = load(*args, **kwargs)
            if kwargs.get("gguf_file"):
                stall(kind, ready)
            return model

        transformers.AutoModelForCausalLM.from_pretrained = from_pretrained
    elif point == "evaluating":  # in the dense model's perplexity, inside the progress bar's loop
        cross_entropy = torch.nn.functional.cross_entropy

        def stalled_cross_entropy(*args, **kwargs):
            stall(kind, ready)
            return cross_entropy(*args, **kwargs)

        torch.nn.functional.cross_entropy = stalled_cross_entropy
    elif point == "writing":
        save = transformers.PreTrainedModel.save_pretrained

        def save_pretrained(self, directory, **kwargs):
            save(self, directory, **kwargs)  # the real files, half of the output directory
            stall(kind, ready)

        transformers.PreTrainedModel.save_pretrained = save_pretrained

    elif point == "exporting":
        from recipe_engine.formats.gguf import writer as gguf_export

        encoding = gguf_export._encoding

        def stalled_encoding(*args, **kwargs):
            stall(kind, ready)
            return encoding(*args, **kwargs)

        gguf_export._encoding = stalled_encoding

    class StallInPass(LayerModifier):
        """Stalls in ``compress_layer`` of layer 1 when POINT is ``pass``; otherwise changes nothing."""

        def target_layers(self, session):
            return list(range(len(session.layers)))

        def compress_layer(self, session, layer_index, stats):
            if point == "pass" and layer_index == 1:
                stall(kind, ready)
            return {}

    REGISTRY._classes["StallInPass"] = StallInPass


def child(case: dict, base: Path) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        (base / f"{case['name']}.pid").write_text(str(os.getpid()))
        err = os.open(base / f"{case['name']}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(err, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.stderr = open(2, "w", closefd=False)
        os.chdir(case["cwd"])
        os.environ.update(case["env"])
        install(case["point"], case["stall"], base / f"{case['name']}.ready")
        code = cli_main(case["argv"])
    finally:
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    cases_file = Path(sys.argv[1])
    base = cases_file.parent
    torch.set_num_threads(1)
    from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: F401  (lazy imports, paid once)
    children = {}
    for case in json.loads(cases_file.read_text()):
        pid = os.fork()
        if pid == 0:
            child(case, base)
        children[pid] = case["name"]
    while children:
        pid, status = os.wait()
        (base / f"{children.pop(pid)}.rc").write_text(str(os.waitstatus_to_exitcode(status)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
