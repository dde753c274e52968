"""``recipe plan``'s estimate of peak host memory, from the config alone (no weights loaded).

    peak ≈ runtime + activations + max over steps (weights held during the step + the step's working memory)

* runtime: this process's resident memory after importing torch and transformers (measured at plan time).
* activations: the calibration tokens' hidden states, four sets (a layer's inputs and outputs, the
  original model's states in lockstep, a step's targets), plus one batch's MLP intermediate (×3).
* weights held: in memory, the whole model; streamed, a layer-scope step holds its largest target layer and
  one original layer (reference), a streaming model-scope step about four layers (a merge: its sources,
  the copy and the result), the embedding or head matrix while it is in use, and a step that does not
  stream (``Modifier.streams``) the whole model (twice with the original model).
* working memory: each step's ``working_memory(shape, tokens)`` (statistics and solve buffers).
"""
from __future__ import annotations

from pathlib import Path

from .schema import Recipe
from .shape import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def runtime_bytes() -> int:
    """Resident memory of this process after importing torch and transformers."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def estimate(recipe: Recipe, config, streamed: bool) -> dict:
    """Peak host bytes and their parts; ``steps`` lists each step's weights and working memory."""
    width = DTYPE_BYTES[recipe.dtype]
    shape = ModelShape.from_config(config)
    cal = recipe.calibration
    tokens = cal.samples * cal.seq_len
    embedding = shape.vocab_size * shape.hidden_size * width
    matrices = 1 if shape.tie_word_embeddings else 2

    def model_bytes(s: ModelShape) -> int:
        return sum(s.layer_parameters(layer) for layer in s.layers) * width + matrices * embedding

    whole = model_bytes(shape)
    steps = []
    for step in recipe.modifiers:
        largest = max(shape.layer_parameters(layer) for layer in shape.layers) * width
        if not streamed:
            held = model_bytes(shape)
        elif step.scope == "layer":
            held = largest + (shape.layer_parameters(shape.layers[0]) * width if step.needs_reference else 0)
        elif step.streams:
            held = 4 * largest
        else:
            held = model_bytes(shape) + (whole if step.needs_reference else 0)
        work = step.working_memory(shape, tokens)
        steps.append({"step": step.step_name(), "weights_bytes": held, "working_bytes": work,
                      "whole_model": not streamed or (step.scope == "model" and not step.streams)})
        step.check(shape)
    intermediate = max(layer.intermediate_size for layer in ModelShape.from_config(config).layers)
    activations = 4 * tokens * shape.hidden_size * width + 3 * cal.batch_size * cal.seq_len * intermediate * 4
    runtime = runtime_bytes()
    peak_step = max(s["weights_bytes"] + s["working_bytes"] for s in steps)
    if streamed:
        peak_step = max(peak_step, embedding)
    return {"streamed": streamed, "runtime_bytes": runtime, "activations_bytes": activations,
            "model_bytes": whole, "steps": steps, "host_peak_bytes": runtime + activations + peak_step}
