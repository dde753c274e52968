"""Piecewise runs of one decoder layer, for steps that change its linears in dataflow order.

A step like GPTQ's "true sequential" needs each linear's input *after* the linears before it changed:
q/k/v, then o_proj, then gate/up, then down_proj. Running the whole layer once per linear costs one layer
forward each. :class:`StagedLayer` instead runs the calibration batches only up to the linear asked for
(the forward stops at that linear's pre-hook), and *replays* a block that is finished: once the input of a
block's output linear (``o_proj`` for attention, ``down_proj`` for the MLP; the adapter's
``output_linears``) is recorded, the block's output is that linear applied to the recorded input, so later
runs skip the block's other work. q/k/v → o → gate/up → down then costs about one layer forward in all
(attention core once, each linear once, o_proj three times and down_proj twice).

Contract: the caller changes modules in dataflow order only, so nothing upstream of a recorded input
changes after it was recorded (asking for a module upstream of a finished block is an error). The block
output check is not assumed: on the first batch the block runs to the end and its output must be the
output linear's result (the same tensor, or one item of a tuple); anything else is a one-line error
naming the block.

Data-parallel (``recipe_engine.execution.distributed``): each rank runs its share of the batches; the statistic fed
by ``inputs_of`` is all-reduced after each run, and ``outputs`` all-gathers the layer's outputs.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from .activations import Activations
from .stats import Statistic, position


class _Stop(Exception):
    pass


def _replay_wrapper(block: str, output: Any, linear_output: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    """How the block wraps its output linear's result: ``y`` itself, or ``y`` at its place in a tuple.
    The tuple's other items (transformers attention returns ``(attn_output, attn_weights)``, the weights a
    tensor under eager attention) are replayed as ``None``: the decoder layers of the supported
    architectures discard them (tested: staged outputs equal full runs under eager and sdpa attention)."""
    if output is linear_output:
        return lambda y: y
    places = [i for i, item in enumerate(output) if item is linear_output] if isinstance(output, tuple) else []
    if len(places) != 1:
        raise NotImplementedError(f"cannot replay '{block}': its output is not its output linear's result")
    return lambda y: tuple(y if i == places[0] else None for i in range(len(output)))


class StagedLayer:
    """One layer over the calibration batches, run up to one linear at a time (see the module docstring).

    ``inputs_of(path, statistic)`` feeds ``statistic`` the input of submodule ``path`` for every batch with
    the layer as it is now; ``outputs()`` returns the layer's outputs (the next layer's activations).
    """

    def __init__(self, session, layer: nn.Module, inputs: Activations):
        # ``session``: the step's view (``ModifierView``); the run's context and work counter are its session's
        self.context, self.work = session.session.context, session.session.work
        self.layer, self.inputs = layer, inputs
        #: block path → (its output linear, that linear's recorded inputs, output wrapper)
        self._finished: dict[str, tuple[nn.Module, list[torch.Tensor], Callable]] = {}
        self._split = self.context.parallel.split(len(inputs))
        #: Batches this process runs (a data-parallel rank: its share); ``_batch`` indexes this list.
        self._own = self._split.own
        self._batch = 0
        self._statistic: Statistic | None = None
        self._position = -1

    def inputs_of(self, path: str, statistic: Statistic) -> None:
        """``statistic.update(x, None)`` with the input ``x`` of submodule ``path`` (a linear) for every batch,
        on the device; stops each forward there. Only a block's output linear keeps its inputs (on storage,
        for replay). Data-parallel: the statistic's sums are all-reduced after the run."""
        block = path.split(".")[0]
        if block in self._finished or position(path) < self._position:
            raise RuntimeError(f"{path}: asked for after a module downstream of it (dataflow order only)")
        self._position = position(path)
        output_linear = self.context.adapter.output_linears.get(block)  # an MoE block has none
        finishing = path == output_linear
        target, block_module = self.layer.get_submodule(path), self.layer.get_submodule(block)
        recorded: list[torch.Tensor] = []
        seen: dict[str, Any] = {}

        def capture(_module, args):
            statistic.update(args[0], None)
            if finishing:
                recorded.append(self.inputs.keep(args[0]))
            if not (finishing and self._batch == 0):
                raise _Stop

        def keep_output(_module, _args, output):
            seen["linear"] = output

        def learn_wrapper(_module, _args, output):
            seen["wrapper"] = _replay_wrapper(block, output, seen["linear"])
            raise _Stop

        self._statistic = statistic
        handles = [target.register_forward_pre_hook(capture)]
        if finishing:
            handles += [target.register_forward_hook(keep_output),
                        block_module.register_forward_hook(learn_wrapper)]
        try:
            self._run()
        finally:
            for handle in handles:
                handle.remove()
            self._statistic = None
        self._split.reduce([statistic])
        if finishing:
            self._finished[block] = (target, recorded, seen["wrapper"])

    def outputs(self) -> Activations:
        """The layer's outputs for every batch (finished blocks replayed); counts as one layer run."""
        outputs = self._run()
        self.work.count(runs=1)
        outputs = self._split.gather(outputs)
        return self.inputs.replace(outputs)

    @torch.no_grad()
    def _run(self) -> list[torch.Tensor]:
        device, replayed = self.context.device, []
        for block, (linear, recorded, wrap) in self._finished.items():
            module = self.layer.get_submodule(block)
            module.forward = lambda *_a, _linear=linear, _recorded=recorded, _wrap=wrap, **_k: \
                _wrap(_linear(self.inputs.load(_recorded[self._batch], device)))
            replayed.append(module)

        def before(position: int, k: int) -> None:
            self._batch = position
            if self._statistic is not None:
                self._statistic.batch = k
            self.work.count(batches=1)

        try:
            with self.context.timings.phase("forward"):
                return self.inputs.run(self.layer, device, self._own, before=before, stops=(_Stop,),
                                       kwargs_of=partial(self.context.adapter.layer_kwargs, self.layer))
        finally:
            for module in replayed:
                del module.forward
