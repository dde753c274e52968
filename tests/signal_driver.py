"""Subprocess driver for tests/test_signals.py: runs ``recipe apply`` and stalls at one point of the run.

``python tests/signal_driver.py POINT STALL READY_FILE -- CLI ARGS...``

POINT is where the run stalls: ``loading`` (before the weights are read), ``converting`` (a GGUF model
being dequantized into the cache, after the tokenizer was saved there), ``pass`` (inside the shared
layer-sequential pass, in a layer step's ``compress_layer``) or ``writing`` (after the checkpoint files are
written into the temporary output directory, before the rename). STALL is ``python`` (an interruptible
``time.sleep``) or ``native`` (one long torch call that does not return to Python for ~30 s, like a large
solve). READY_FILE is created when the stall begins, so the test knows when to send its signal.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


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


def main() -> int:
    point, kind, ready = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    argv = sys.argv[sys.argv.index("--") + 1:]
    torch.set_num_threads(1)

    from recipe_engine import runner
    from recipe_engine.cli import main as cli_main
    from recipe_engine.modifier import LayerModifier
    from recipe_engine.registry import REGISTRY

    if point == "loading":
        original = runner.load_model

        def load_model(*args, **kwargs):
            stall(kind, ready)
            return original(*args, **kwargs)

        runner.load_model = load_model
    elif point == "converting":  # inside the GGUF conversion, its cache temp directory populated
        import transformers

        load = transformers.AutoModelForCausalLM.from_pretrained

        def from_pretrained(*args, **kwargs):
            model = load(*args, **kwargs)
            if kwargs.get("gguf_file"):
                stall(kind, ready)
            return model

        transformers.AutoModelForCausalLM.from_pretrained = from_pretrained
    elif point == "writing":
        import transformers

        save = transformers.PreTrainedModel.save_pretrained

        def save_pretrained(self, directory, **kwargs):
            save(self, directory, **kwargs)  # the real files, half of the output directory
            stall(kind, ready)

        transformers.PreTrainedModel.save_pretrained = save_pretrained

    class StallInPass(LayerModifier):
        """Stalls in ``compress_layer`` of layer 1 when POINT is ``pass``; otherwise changes nothing."""

        def target_layers(self, session):
            return list(range(len(session.layers)))

        def compress_layer(self, session, layer_index, stats):
            if point == "pass" and layer_index == 1:
                stall(kind, ready)
            return {}

    REGISTRY._classes["StallInPass"] = StallInPass
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
