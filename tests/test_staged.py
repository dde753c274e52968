"""StagedLayer (piecewise layer runs with finished blocks replayed) and ``current_layer.provide_outputs``."""
import pytest
import torch

from recipe_engine.recipe.modifier import LayerModifier
from recipe_engine.execution.staged import StagedLayer
from recipe_engine.execution.stats import Statistic
from tests.helpers import random_tokens, run_pass, tiny_model
from tests.test_session import make_session

SOURCES = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]


class Collect(Statistic):
    """Keeps every input it is fed."""

    def __init__(self, module: str):
        super().__init__(module)
        self.values = []

    def update(self, inputs, output):
        self.values.append(inputs)


def hooked_inputs(session, layer, path):
    """Input of ``path`` for every batch from a plain full run of the layer."""
    seen = []
    handle = layer.get_submodule(path).register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
    try:
        outputs = session.run_layer(layer, session.capture_inputs())
    finally:
        handle.remove()
    return seen, outputs


def perturb(layer, path):
    with torch.no_grad():
        layer.get_submodule(path).weight.mul_(0.5).add_(0.01)


@pytest.mark.parametrize("model_type,attention", [("llama", "sdpa"), ("mistral", "sdpa"), ("qwen2", "sdpa"),
                                                   ("llama", "eager")])
def test_staged_inputs_and_outputs_equal_full_runs_as_the_layer_changes(model_type, attention):
    """Each source's input is taken after the sources before it were changed, as a full run of the
    changed layer gives; the final outputs (attention and MLP replayed) equal a full run's. Eager attention
    also returns its weights, which the replay drops."""
    model = tiny_model(model_type, attn_implementation=attention)
    session = make_session(model, random_tokens(4, 24))
    layer = session.layers[0]
    staged = StagedLayer(session, layer, session.capture_inputs())
    for path in SOURCES:
        expected, _ = hooked_inputs(session, layer, path)
        got = Collect(path)
        staged.inputs_of(path, got)
        assert len(got.values) == len(expected) == 2
        for a, b in zip(got.values, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        perturb(layer, path)
    _, expected_outputs = hooked_inputs(session, layer, "mlp.down_proj")
    for a, b in zip(staged.outputs(), expected_outputs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_replay_skips_the_attention_core():
    """After o_proj's input is recorded, later runs never call q_proj (the attention block is replayed)."""
    model = tiny_model()
    session = make_session(model, random_tokens(4, 24))
    layer = session.layers[0]
    staged = StagedLayer(session, layer, session.capture_inputs())
    staged.inputs_of("self_attn.o_proj", Collect(""))
    calls = []
    handle = layer.self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    staged.inputs_of("mlp.gate_proj", Collect(""))
    staged.outputs()
    handle.remove()
    assert calls == [] and "forward" not in vars(layer.self_attn)  # the replay is removed again


def test_asking_upstream_of_a_finished_block_is_an_error():
    model = tiny_model()
    session = make_session(model, random_tokens(4, 24))
    staged = StagedLayer(session, session.layers[0], session.capture_inputs())
    staged.inputs_of("mlp.gate_proj", Collect(""))
    with pytest.raises(RuntimeError, match="self_attn.o_proj: asked for after"):
        staged.inputs_of("self_attn.o_proj", Collect(""))


def test_a_block_that_changes_its_output_linears_result_is_refused():
    model = tiny_model()
    session = make_session(model, random_tokens(4, 24))
    layer = session.layers[0]
    layer.mlp.register_forward_hook(lambda _m, _a, output: output * 2)
    staged = StagedLayer(session, layer, session.capture_inputs())
    with pytest.raises(NotImplementedError, match="cannot replay 'mlp'"):
        staged.inputs_of("mlp.down_proj", Collect(""))


class HalvesDown(LayerModifier):
    """Test double: halves layer 0's down_proj; ``zeros: true`` hands over all-zero outputs."""

    zeros: bool = False

    def target_layers(self, session):
        return [0]

    def compress_layer(self, session, layer_index, stats):
        with torch.no_grad():
            session.layers[layer_index].mlp.down_proj.weight.mul_(0.5)
        if self.zeros:
            inputs = session.current_layer.inputs
            session.current_layer.provide_outputs(inputs.replace([torch.zeros_like(x) for x in inputs]))
        return {}


RECORDED_INPUTS: list[torch.Tensor] = []


class RecordsInputs(LayerModifier):
    """Test double: records the inputs of layer 1."""

    def target_layers(self, session):
        return [1]

    def compress_layer(self, session, layer_index, stats):
        RECORDED_INPUTS.append(torch.cat(session.current_layer.inputs.states))
        return {}


def layer1_inputs(steps):
    session = make_session(tiny_model(), random_tokens(4, 24))
    RECORDED_INPUTS.clear()
    run_pass(session, [*steps, RecordsInputs()])
    return RECORDED_INPUTS[-1]


def test_provided_outputs_are_the_next_layers_inputs_unless_a_later_step_changes_the_layer():
    assert torch.count_nonzero(layer1_inputs([HalvesDown(zeros=True)])) == 0
    reference = tiny_model()
    with torch.no_grad():
        reference.model.layers[0].mlp.down_proj.weight.mul_(0.25)
        expected = reference(random_tokens(4, 24), output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(layer1_inputs([HalvesDown(zeros=True), HalvesDown()]), expected,
                               rtol=1e-5, atol=1e-5)


def test_provide_outputs_outside_compress_layer_is_an_error():
    session = make_session(tiny_model(), random_tokens(4, 24))
    with pytest.raises(RuntimeError, match="only available inside compress_layer"):
        session.current_layer.provide_outputs([])
