"""``recipe plan``'s estimate of peak host memory, from the config alone (no weights loaded).

    peak ≈ runtime + activations + max over steps (weights held during the step + the step's working memory)

* runtime: resident memory of a process that has done what ``apply`` does before loading weights (imports,
  calibration text, tokenizer, token ids): measured in the planning process (``runtime_bytes``), or passed
  in by ``apply`` itself.
* activations: the calibration tokens' hidden states, four sets (a layer's inputs and outputs, the
  original model's states in lockstep, a step's targets), plus one batch's MLP intermediate (×3).
* weights held: in memory, the whole model; streamed, a layer-scope step holds its largest target layer and
  one original layer (reference), a streaming model-scope step about four layers (a merge: its sources,
  the copy and the result) or the embedding matrix its passes start with, whichever is larger, and a step that does not
  stream (``Modifier.streams``) the whole model (twice with the original model); a streamed step's pass also
  holds the next layer, read from disk while the current one computes (``read_ahead_bytes``).
* working memory: each step's ``working_memory(shape, tokens)`` (statistics and solve buffers).
* on a CUDA GPU (``accelerator``): the runtime's own host memory (:data:`ACCELERATOR_RUNTIME_BYTES`: the CUDA
  context, its libraries and handles) and, in a streamed pass, two page-locked copies of the largest layer:
  the next layer read ahead for the device and a changed layer on its way to staging, each tensor rounded
  up to a power of two by torch's caching host allocator (``pinned_bytes``).
* kept original states: from a step whose pass keeps the original model's states for a later step that reads
  the original (``kept_states_bytes``) through that later step, one set per layer, at most a quarter of the
  host memory available when the plan is made (the run's budget: ``ReferenceWalk.start_keeping``).
* evaluation (``evaluate: perplexity``): the model and one window's logits (``evaluation_logits_bytes``), on the
  device when the activations are there (an in-memory model moves there whole), else on the host; the peak
  is the larger of the steps' and the evaluation's.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch

from ..architectures.shape import DTYPE_BYTES, ModelShape
from ..sources.windows import calibration_windows, load_calibration
from ..sources.models import resolve_model
from ..recipe.modifier import calibration_nll_bytes, kept_original_sets
from ..recipe.schema import Recipe
from ..system.host_memory import available_memory, current_rss
from .compiled import Plan, compile_plan


#: Host memory a CUDA GPU's runtime adds to a process: a bare process that imported torch and ran a Cholesky
#: and a matmul on one H200 (torch 2.11, CUDA 13) was resident at 0.85 GiB (``benchmarks/acceptance/moe.py``'s
#: ``bare_runtime_host_gib``); counted whole, though the planning process's runtime already holds torch's import.
ACCELERATOR_RUNTIME_BYTES = int(0.85 * 2**30)


def unmeasured_accelerator_runtime(device) -> int:
    """:data:`ACCELERATOR_RUNTIME_BYTES` on a CUDA ``device`` whose runtime this process has not started yet (a
    runtime measured now lacks it), else 0."""
    return ACCELERATOR_RUNTIME_BYTES if device.type == "cuda" and not torch.cuda.is_initialized() else 0


def pinned_bytes(sizes) -> int:
    """Page-locked host bytes of tensors of ``sizes`` bytes each: torch's caching host allocator
    (``pin_memory=True``) rounds every block up to a power of two (a Qwen3-30B-A3B layer: 1.25 GB, pinned 1.65 GB)."""
    return sum(1 << (size - 1).bit_length() for size in sizes if size > 0)


def runtime_bytes(recipe: Recipe) -> int:
    """Resident memory of this process after doing what ``apply`` does before it loads weights: import
    the engine (done: this module sits above execution and evaluation, and the CLI imports every command at
    start) and the model classes, read the calibration text, load the tokenizer and tokenize."""
    # deferred: the model classes are imported here on purpose, as apply imports them before loading weights
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    calibration_windows(AutoTokenizer.from_pretrained(resolve_model(recipe.model).location),
                        load_calibration(recipe.calibration), recipe.calibration)
    return current_rss()


def shape_bytes(shape: ModelShape, width: int) -> int:
    """Bytes of a model of this symbolic shape at ``width`` bytes per parameter (tied embeddings once)."""
    matrices = 1 if shape.tie_word_embeddings else 2
    return (sum(shape.layer_parameters(layer) for layer in shape.layers) * width
            + matrices * shape.vocab_size * shape.hidden_size * width + shape.hidden_size * width)


def plan_output_bytes(plan: Plan) -> int:
    """Bytes of the checkpoint the recipe writes: the model the plan leaves (fewer, narrower layers), in the
    recipe's dtype; a packed quantized export is counted unpacked (an upper bound)."""
    return shape_bytes(plan.final, DTYPE_BYTES[plan.recipe.dtype])


def output_bytes(recipe: Recipe, config) -> int:
    """:func:`plan_output_bytes` of the recipe compiled against ``config``."""
    return plan_output_bytes(compile_plan(recipe, config))


@dataclass
class StepMemory:
    """One step's part of the estimate: the weights it holds, its working memory, whether it needs the whole
    model resident, and what the host holds during it."""

    step: str
    weights_bytes: int
    working_bytes: int
    whole_model: bool
    host_bytes: int = 0
    kept_states_bytes: int = 0
    #: A streamed pass's next layer, read into host memory while the current one computes.
    read_ahead_bytes: int = 0
    #: On a CUDA GPU, a streamed pass's page-locked host copies: the next layer read ahead for the device and
    #: a changed layer on its way to staging (:func:`pinned_bytes` of the largest layer, twice).
    pinned_bytes: int = 0
    #: The weights on the accelerator during the step: what a streamed run materializes (the layers in use;
    #: a model-scope step that does not stream, the whole model), in memory too, where the run moves those
    #: layers there and back (``Residency.using``).
    device_weights_bytes: int = 0


@dataclass
class MemoryPlan:
    """The memory estimate of a plan (:func:`plan_memory`); ``to_dict`` is its form in ``recipe plan --json``."""

    streamed: bool
    on_device: bool
    runtime_bytes: int
    activations_bytes: int
    model_bytes: int
    steps: list[StepMemory]
    host_peak_bytes: int
    #: With the activations on the device: its peak (the activations and the largest step, or an in-memory
    #: evaluation's whole model, whichever is larger); else None.
    device_peak_bytes: int | None = None
    #: An in-memory run's ``evaluate: perplexity`` on the device: the whole model and one window's logits.
    evaluation_device_bytes: int = 0
    #: ``evaluate: perplexity`` on the host (activations there): the runtime, the model held and one window.
    evaluation_host_bytes: int = 0
    #: One perplexity window's logits (``evaluation_logits_bytes``), wherever the evaluation runs.
    evaluation_window_bytes: int = 0
    #: On a CUDA GPU, the runtime's own host memory (:data:`ACCELERATOR_RUNTIME_BYTES`; 0 when the measured
    #: runtime already holds it), resident through every step beside ``runtime_bytes``.
    accelerator_runtime_bytes: int = 0

    def to_dict(self) -> dict:
        memory = asdict(self)
        if self.device_peak_bytes is None:
            del memory["device_peak_bytes"]
        return memory


def kept_states_bytes(plan: Plan, budget: int) -> list[int]:
    """Per step, the bytes of the original model's states kept on the host for a step that reads the original
    model (``recipe_engine.recipe.modifier.kept_original_sets``: one ``seq_len × hidden`` set per window and
    layer, in the recipe's dtype), at most ``budget`` (the run keeps what fits in a quarter of the available
    memory: ``ReferenceWalk.start_keeping``). They stay until the last step reading them is done (its walk
    drops them as it goes deeper, but the heap keeps the peak)."""
    recipe = plan.recipe
    one_set = recipe.calibration.seq_len * plan.shapes[0].hidden_size * DTYPE_BYTES[recipe.dtype]
    return [min(sets * one_set, budget)
            for sets in kept_original_sets(plan.steps, plan.shapes, recipe.calibration.samples)]


def plan_memory(plan: Plan, streamed: bool, runtime: int | None = None, on_device: bool = False,
                accelerator: bool = False, accelerator_runtime: int = ACCELERATOR_RUNTIME_BYTES) -> MemoryPlan:
    """Peak host bytes and their parts; ``steps`` lists each step's weights and working memory, on the
    shape the plan says it receives.

    ``on_device``: the run keeps the calibration activations on an accelerator (``calibration.offload``
    resolved false), where the steps' statistics and solves live too. Then the host holds the runtime and
    the weights a step holds (they are read there and moved layer by layer), and ``device_peak_bytes`` is
    the activations plus the largest step's weights and working memory. The kept original states are bounded
    by a quarter of the host memory available now. ``accelerator``: the layers compute on a CUDA GPU (with the
    activations there or not): the host also holds ``accelerator_runtime`` and a streamed pass's page-locked
    copies (``StepMemory.pinned_bytes``)."""
    recipe = plan.recipe
    width = DTYPE_BYTES[recipe.dtype]
    first = plan.shapes[0]
    cal = recipe.calibration
    tokens = cal.samples * cal.seq_len
    embedding = first.vocab_size * first.hidden_size * width
    intermediate = first.intermediate_size  # of the original layers: one batch's MLP activations

    whole = shape_bytes(first, width)
    steps = []
    for step, received in zip(plan.steps, plan.shapes):
        shape = steps_shape(received, recipe, streamed, on_device)
        largest = max(shape.layer_parameters(layer) for layer in shape.layers) * width
        pinned = max(pinned_bytes(n * width for n in shape.layer_tensors(layer)) for layer in shape.layers)
        if step.scope == "layer":
            in_use = largest + (shape.layer_parameters(shape.layers[0]) * width if step.needs_reference else 0)
        elif step.streams:  # its passes start with the embeddings loaded beside its buffers
            in_use = max(4 * largest, embedding)
        else:
            in_use = shape_bytes(shape, width) + (whole if step.needs_reference else 0)
        held = in_use if streamed else shape_bytes(shape, width)
        whole_model = not streamed or (step.scope == "model" and not step.streams)
        steps.append(StepMemory(step.step_name(), held, step.working_memory(shape, tokens), whole_model,
                                read_ahead_bytes=0 if whole_model else largest, device_weights_bytes=in_use,
                                pinned_bytes=2 * pinned if accelerator and not whole_model else 0))
    activations = 4 * tokens * first.hidden_size * width + 3 * cal.batch_size * cal.seq_len * intermediate * 4
    runtime = runtime_bytes(recipe) if runtime is None else runtime
    accelerator_runtime = accelerator_runtime if accelerator else 0
    resident = runtime + accelerator_runtime + (0 if on_device else activations)  # through every step
    if not on_device:  # kept only when the activations live on the host
        budget = available_memory() // 4
        for step, kept in zip(steps, kept_states_bytes(plan, budget)):
            step.kept_states_bytes = kept
    for step in steps:  # what the host holds during the step
        step.host_bytes = resident + step.weights_bytes + step.read_ahead_bytes + step.pinned_bytes \
            + step.kept_states_bytes \
            + (0 if on_device else step.working_bytes)
    host_peak = max(s.host_bytes for s in steps)
    if streamed:  # a streamed run's passes start with the embeddings loaded
        host_peak = max(host_peak, resident + embedding)
    logits = evaluation_logits_bytes(recipe, steps_shape(first, recipe, streamed))
    evaluation = whole + logits if logits and not streamed else 0  # evaluate_model: the whole model there
    device_peak = None
    if on_device:
        device_peak = max(activations + max(s.device_weights_bytes + s.working_bytes for s in steps), evaluation)
    evaluation_host = 0
    if logits and not on_device:  # the evaluation on the host: the model held as by the steps, one window
        held = whole if not streamed else max(max(s.device_weights_bytes for s in steps), embedding)
        evaluation_host = runtime + accelerator_runtime + held + logits
        host_peak = max(host_peak, evaluation_host)
    return MemoryPlan(streamed, on_device, runtime, activations, whole, steps, host_peak, device_peak, evaluation,
                      evaluation_host, logits, accelerator_runtime)


def steps_shape(shape: ModelShape, recipe: Recipe, streamed: bool, on_device: bool = False) -> ModelShape:
    """A copy of ``shape`` with the run's facts a step's memory estimate reads (streamed, dtype, device,
    calibration batch)."""
    shape = copy.deepcopy(shape)
    shape.streamed, shape.dtype_bytes, shape.on_device = streamed, DTYPE_BYTES[recipe.dtype], on_device
    shape.calibration_batch, shape.calibration_seq_len = recipe.calibration.batch_size, recipe.calibration.seq_len
    return shape


def evaluation_logits_bytes(recipe: Recipe, shape: ModelShape) -> int:
    """The transient of ``evaluate: perplexity`` (0 without one). In memory, one window at a time
    (``perplexity.window_nll``): its logits in fp32 (a bf16 model's are copied, the copy outlives them) and
    the fp32 log-softmax ``cross_entropy`` makes of them, 8 bytes per position and word (2.5 GB at 2048
    tokens of a 151,936-word vocabulary). Streamed, a calibration NLL over the windows in batches
    (``calibration_nll_bytes``)."""
    if recipe.evaluate is None or recipe.evaluate.perplexity is None:
        return 0
    ppl = recipe.evaluate.perplexity
    if shape.streamed:
        return calibration_nll_bytes(shape, ppl.limit or shape.calibration_batch, ppl.seq_len)
    return ppl.seq_len * shape.vocab_size * 8


def estimate(recipe: Recipe, config, streamed: bool, runtime: int | None = None,
             on_device: bool = False, accelerator: bool = False) -> MemoryPlan:
    """:func:`plan_memory` of the recipe compiled against ``config``."""
    return plan_memory(compile_plan(recipe, config), streamed, runtime, on_device, accelerator)
