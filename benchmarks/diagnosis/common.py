"""What the diagnosis scripts share: their command line, the dense model, and a method's model built as the
held-out protocol builds it (``compare_methods``: 32 × 512 Wikipedia-sample tokens, seed 0)."""
from __future__ import annotations

import argparse
import copy

import torch

import recipe_engine
from benchmarks.compare_methods import CALIBRATIONS, MODELS, methods
from recipe_engine.sources.models import load_model


def parser(description: str, default_methods: list[str]) -> argparse.ArgumentParser:
    """``--model``, ``--methods`` and ``--threads``; a script adds its own options."""
    parse = argparse.ArgumentParser(description=description)
    parse.add_argument("--model", choices=list(MODELS), default="smollm2-135m")
    parse.add_argument("--methods", nargs="*", default=default_methods)
    parse.add_argument("--threads", type=int, default=1)
    return parse


def load_dense(args: argparse.Namespace):
    """``(dense model in eval mode, tokenizer, n)`` with the threads and seed set; n: the model's budget."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dense, tokenizer, _ = load_model(args.model, "float32")
    return dense.eval(), tokenizer, MODELS[args.model]


def heldout_model(model: str, dense, tokenizer, method: str, n: int):
    """``method``'s model of a copy of ``dense`` (the dense model itself for ``dense``), calibrated as the
    held-out protocol calibrates."""
    return heldout_run(model, dense, tokenizer, method, n)[0]


def heldout_run(model: str, dense, tokenizer, method: str, n: int):
    """``(model, report)`` of ``heldout_model`` (the report None for ``dense``)."""
    steps, overrides = methods(n, dense.config.num_hidden_layers)[method]
    if not steps:
        return dense, None
    dataset, split = CALIBRATIONS["wikipedia"]
    recipe = {"version": 1, "name": "diagnosis", "model": model, "output": "out/unused",
              "calibration": {"dataset": dataset, "split": split, "samples": 32, "seq_len": 512, "seed": 0,
                              **overrides}, "modifiers": steps}
    compressed, report = recipe_engine.apply(recipe, model=copy.deepcopy(dense), tokenizer=tokenizer, write=False,
                                             progress=False)
    return compressed.eval(), report
