"""Layer-sequential session: captured inputs, layer passes and statistics match a plain forward."""
import copy

import pytest
import torch

from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.recipe.modifier import LayerModifier
from recipe_engine.recipe.schema import CalibrationConfig
from recipe_engine.execution.context import RunContext
from recipe_engine.execution.session import Session
from recipe_engine.execution.stats import InputCovariance
from tests.helpers import layer_kwargs, random_tokens, run_pass, tiny_model


def make_session(model, tokens, **cal):
    config = CalibrationConfig(samples=tokens.shape[0], seq_len=tokens.shape[1], batch_size=2, **cal)
    return Session(RunContext(None, adapter_for(model.config), config, torch.device("cpu")), model, tokens).view


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_layer_pass_reproduces_hidden_states(model_type):
    model = tiny_model(model_type)
    tokens = random_tokens(4, 24)
    reference = model(tokens, output_hidden_states=True).hidden_states
    seen = {}
    make_session(model, tokens).layer_pass(lambda i, inp, out: seen.setdefault(i, (inp, out)))
    for index in range(model.config.num_hidden_layers):
        inputs = torch.cat(seen[index][0].states)
        torch.testing.assert_close(inputs, reference[index], rtol=1e-5, atol=1e-5)
    # the last layer's output before the final norm: compare through the norm
    last = torch.cat(seen[model.config.num_hidden_layers - 1][1].states)
    torch.testing.assert_close(model.model.norm(last), reference[-1], rtol=1e-5, atol=1e-5)


def test_calibration_nll_matches_model_loss():
    model = tiny_model()
    tokens = random_tokens(4, 24)
    with torch.no_grad():
        loss = model(tokens, labels=tokens).loss
    assert make_session(model, tokens).calibration_nll() == pytest.approx(float(loss), rel=1e-5)


def test_per_window_nll_matches_model_loss_window_by_window():
    """Five windows in batches of two (the last batch short): each window's NLL is HF's loss on it alone,
    in window order, and their mean is the token-weighted NLL."""
    model = tiny_model()
    tokens = random_tokens(5, 24, seed=4)
    with torch.no_grad():
        expected = [float(model(w[None], labels=w[None]).loss) for w in tokens]
    session = make_session(model, tokens)  # batch_size 2
    windows = session.calibration_nll(per_window=True)
    assert windows == pytest.approx(expected, rel=1e-5)
    assert session.calibration_nll() == pytest.approx(sum(expected) / 5, rel=1e-6)


class RecordingModifier(LayerModifier):
    """Test double: collects the down_proj input covariance and zeroes the MLP of its layers."""

    layers: list[int]

    def target_layers(self, session):
        return self.layers

    def statistics(self, session, layer_index):
        return [InputCovariance("mlp.down_proj")]

    def compress_layer(self, session, layer_index, stats):
        stat = stats["InputCovariance:mlp.down_proj"]
        with torch.no_grad():
            session.layers[layer_index].mlp.down_proj.weight.zero_()
        return {"tokens": stat.count, "trace": float(stat.gram.trace())}


def _down_input_gram(model, tokens, layer_index):
    grams = []
    handle = model.model.layers[layer_index].mlp.down_proj.register_forward_hook(
        lambda m, args, out: grams.append(args[0].reshape(-1, args[0].shape[-1]).double()))
    model(tokens)
    handle.remove()
    x = torch.cat(grams)
    return x.T @ x


@pytest.mark.parametrize("propagate", ["compressed", "original"])
def test_layer_group_statistics_follow_propagation(propagate):
    model = tiny_model()
    tokens = random_tokens(4, 16)
    # reference statistics: layer 2 sees layer 1's MLP zeroed (compressed) or not (original)
    reference_model = copy.deepcopy(model)
    if propagate == "compressed":
        with torch.no_grad():
            reference_model.model.layers[1].mlp.down_proj.weight.zero_()
    expected = _down_input_gram(reference_model, tokens, 2)
    modifier = RecordingModifier(layers=[1, 2])
    report = run_pass(make_session(model, tokens, propagate=propagate), [modifier])
    assert report["0"]["layers"]["2"]["tokens"] == tokens.numel()
    assert report["0"]["layers"]["2"]["trace"] == pytest.approx(float(expected.trace()), rel=1e-6)


class TargetProbe(LayerModifier):
    """Test double: records, for each target layer, its inputs, the serial original layers on those
    inputs, and the original model's hidden state at that depth; zeroes its MLP (a compression)."""

    layers: list[int]
    seen: dict = {}

    def target_layers(self, session):
        return self.layers

    def statistics(self, session, layer_index):
        return []

    def compress_layer(self, session, layer_index, stats):
        inputs = session.current_layer.inputs
        self.seen[layer_index] = (torch.cat(inputs.states),
                                  torch.cat(session.original_outputs(layer_index, inputs).states),
                                  torch.cat(session.original_outputs(layer_index).states))
        with torch.no_grad():
            session.layers[layer_index].mlp.down_proj.weight.zero_()
        return {}


def test_compress_layer_sees_inputs_serial_and_original_targets():
    """Layers 1 and 2 of a 4-layer model merged into one (origin (1, 2)); layer 0 compressed first, so the
    merged layer's inputs differ from the original model's and the two targets differ."""
    model = tiny_model()
    original = copy.deepcopy(model)
    tokens = random_tokens(4, 16)
    with torch.no_grad():
        hidden = original(tokens, output_hidden_states=True).hidden_states
    config = CalibrationConfig(samples=4, seq_len=16, batch_size=2)
    session = Session(RunContext(None, adapter_for(model.config), config, torch.device("cpu")),
                      model, tokens, reference_loader=lambda: original).view
    layers = list(model.model.layers)
    session.set_layers([layers[0], layers[1], layers[3]], [(0,), (1, 2), (3,)], [0, 1, 3])
    probe = TargetProbe(layers=[0, 1, 2])
    run_pass(session, [probe])
    torch.testing.assert_close(probe.seen[0][0], hidden[0])
    torch.testing.assert_close(probe.seen[0][2], hidden[1], rtol=1e-5, atol=1e-5)
    inputs, serial, reference = probe.seen[1]
    assert not torch.allclose(inputs, hidden[1], atol=1e-3)  # layer 0 was compressed
    torch.testing.assert_close(reference, hidden[3], rtol=1e-5, atol=1e-5)  # after original layers 1, 2
    by_hand, kwargs = inputs, layer_kwargs(original, inputs)
    with torch.no_grad():
        for index in (1, 2):
            by_hand = original.model.layers[index](by_hand, **kwargs)
            by_hand = by_hand[0] if isinstance(by_hand, tuple) else by_hand
    torch.testing.assert_close(serial, by_hand, rtol=1e-5, atol=1e-5)
    # HF's last hidden state has the final norm applied
    torch.testing.assert_close(original.model.norm(probe.seen[2][2]), hidden[4], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="only available inside compress_layer"):
        session.current_layer


def test_input_covariance_fp32_products_agree_with_fp64_and_are_keyed_apart():
    x = torch.randn(3, 64, 40, generator=torch.Generator().manual_seed(1)) * 5
    exact, fast = InputCovariance("mlp.down_proj"), InputCovariance("mlp.down_proj", products=torch.float32)
    for batch in x.split(1):
        exact.update(batch, None)
        fast.update(batch, None)
    reference = x.reshape(-1, 40).double().T @ x.reshape(-1, 40).double()
    torch.testing.assert_close(exact.gram, reference, rtol=1e-12, atol=1e-9)
    assert fast.gram.dtype == torch.float64 and not torch.equal(fast.gram, reference)
    torch.testing.assert_close(fast.gram, reference, rtol=1e-5, atol=1e-3)
    assert exact.key == "InputCovariance:mlp.down_proj" and fast.key != exact.key


def test_layer_keyword_arguments_move_to_the_device_with_nesting():
    """Captured layer kwargs (a dict holding the (cos, sin) tuple) reach the session device whole."""
    from recipe_engine.execution.activations import load

    kwargs = {"position_embeddings": (torch.ones(2), torch.zeros(2)), "attention_mask": torch.ones(1), "flag": 3}
    moved = load(kwargs, torch.device("meta"))
    assert [t.device.type for t in moved["position_embeddings"]] == ["meta", "meta"]
    assert moved["attention_mask"].device.type == "meta" and moved["flag"] == 3


def test_input_covariance_row_panels_equal_one_product(monkeypatch):
    """The Gram summed in row panels (no second n × n product) equals ``XᵀX`` of all batches."""
    import recipe_engine.execution.stats as stats

    monkeypatch.setattr(stats, "ROW_PANEL", 16)
    x = torch.randn(4, 10, 50, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    statistic = InputCovariance("mlp.down_proj")
    for batch in x.split(1):
        statistic.update(batch, None)
    flat = x.reshape(-1, 50)
    torch.testing.assert_close(statistic.gram, flat.T @ flat, rtol=1e-13, atol=1e-11)
    assert statistic.count == 40


class ReleasingModifier(RecordingModifier):
    """Test double: reads the down_proj Gram, then releases it (and changes nothing)."""

    def compress_layer(self, session, layer_index, stats):
        stat = stats["InputCovariance:mlp.down_proj"]
        trace = float(stat.gram.trace())
        stat.release()
        return {"trace": trace}


def test_released_statistic_is_freed_and_recollected_for_a_later_step():
    model = tiny_model()
    tokens = random_tokens(4, 16)
    expected = float(_down_input_gram(copy.deepcopy(model), tokens, 1).trace())
    first, second = ReleasingModifier(layers=[1]), RecordingModifier(layers=[1])
    report = run_pass(make_session(model, tokens), [first, second])
    assert report["0"]["layers"]["1"]["trace"] == pytest.approx(expected, rel=1e-6)
    # the second step got a freshly collected Gram, not the released (None) one
    assert report["1"]["layers"]["1"]["trace"] == pytest.approx(expected, rel=1e-6)
    statistic = InputCovariance("mlp.down_proj")
    statistic.update(torch.ones(1, 2, 3), None)
    statistic.release()
    assert statistic.gram is None and statistic.count is None and statistic.released


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_dropped_branch_frees_its_model_without_the_cyclic_collector(model_type):
    """A branch that captured its inputs and ran a layer pass holds no reference cycle back to itself: its
    copy of the model is freed by reference counting alone when the branch is dropped (with the cyclic
    collector off), so alternatives tried one after another never pile up copies of the model."""
    import gc
    import weakref

    model = tiny_model(model_type)
    tokens = random_tokens(4, 24)
    session = make_session(model, tokens)
    gc.collect()
    gc.disable()
    try:
        branch = session.branch(session.calibration)
        branch.layer_pass(lambda i, inp, out: None)
        assert branch.calibration_nll() > 0
        copied, held = weakref.ref(branch.model), weakref.ref(branch)
        del branch
        assert held() is None and copied() is None
    finally:
        gc.enable()


def test_a_branch_keeps_what_the_run_produced_before_it():
    """Extras, files and quantization records made before a branch survive its adoption, the records keyed
    to the adopted model's own linears (a branch starts from a copy of the run's outputs)."""
    from recipe_engine.numerics.quantization import Grid

    model = tiny_model()
    session = make_session(model, random_tokens(4, 24))
    linear = session.layers[0].mlp.down_proj
    rows, columns = linear.weight.shape
    session.outputs.add_extra("Earlier", {"k": 1}, {"t": torch.ones(2)})
    session.outputs.add_artifact("earlier.txt", b"x")
    session.outputs.mark_quantized(linear, Grid(bits=4, group_size=columns, sym=False),
                                   torch.ones(rows, 1), torch.zeros(rows, 1), "compressed-tensors")
    branch = session.branch(session.calibration)
    branch.outputs.add_extra("Later", {}, {})
    session.adopt(branch)
    assert [extra["modifier"] for extra in session.outputs.extras] == ["Earlier", "Later"]
    assert session.outputs.artifacts == {"earlier.txt": b"x"}
    ((kept, parameter),) = session.outputs.quantized
    assert kept is session.layers[0].mlp.down_proj and kept is not linear and parameter == "weight"


def test_a_statistics_only_run_stops_after_the_last_block_it_reads():
    """A step's statistics run whose outputs are not needed stops each forward after the last block a
    statistic reads (``last_block``): the o_proj Gram equals a full run's, bit for bit, and the MLP never runs."""
    from recipe_engine.execution.pipeline import last_block
    from recipe_engine.execution.stats import InputCovariance

    model = tiny_model(num_hidden_layers=2)
    session = make_session(model, random_tokens(4, 16))
    inputs = session.capture_inputs()
    layer = session.layers[0]
    full, early = InputCovariance("self_attn.o_proj"), InputCovariance("self_attn.o_proj")
    session.run_layer(layer, inputs, hooks=[full])
    mlp_ran = []
    handle = layer.mlp.register_forward_hook(lambda *_: mlp_ran.append(True))
    try:
        returned = session.session.pipeline.run_layer(layer, inputs, hooks=[early], stop_after=last_block([early]))
    finally:
        handle.remove()
    assert torch.equal(full.gram, early.gram) and full.count == early.count
    assert returned is None and not mlp_ran
    assert last_block([early]) == "self_attn"
    assert last_block([early, InputCovariance("mlp.down_proj")]) == "mlp"
    assert last_block([early, InputCovariance("")]) is None and last_block([]) is None


def test_reference_states_kept_by_an_as_received_pass_equal_the_walk(tmp_path, monkeypatch):
    """After only output-preserving steps, FlattenAdjacent's similarity pass runs the reference model and keeps
    its states; NystromMLP's ``target: original`` walk then starts from them instead of layer 0. The result is
    byte-identical to a run that keeps nothing (what a resumed run does) and runs fewer layers."""
    import recipe_engine
    import recipe_engine.execution.reference_walk as reference_walk
    from tests.helpers import save_tiny_model

    save_tiny_model(tmp_path / "model", num_hidden_layers=6)
    (tmp_path / "cal.txt").write_text("The quick brown fox jumps over the lazy dog. " * 80)
    recipe = {"version": 1, "name": "kept", "model": str(tmp_path / "model"), "dtype": "float32",
              "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 6, "seq_len": 32, "batch_size": 2},
              "modifiers": ["FuseNorm", "FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"]}
    taken, walked_layers = [], []
    original_take, original_walk = reference_walk.KeptStates.take, reference_walk.ReferenceWalk.run_original
    monkeypatch.setattr(reference_walk.KeptStates, "take",
                        lambda self, depth, after: taken.append(original_take(self, depth, after)) or taken[-1])
    monkeypatch.setattr(reference_walk.ReferenceWalk, "run_original", lambda self, indices, *args: (
        walked_layers.append(len(indices)), original_walk(self, indices, *args))[1])
    recipe_engine.apply({**recipe, "output": str(tmp_path / "kept")}, progress=False, checkpoints=False)
    assert any(start is not None and start.next > 1 for start in taken)
    kept_walk, walked_layers[:] = sum(walked_layers), []
    monkeypatch.setattr(reference_walk, "available_memory", lambda: 0)  # nothing fits: every target walks from layer 0
    taken.clear()
    recipe_engine.apply({**recipe, "output": str(tmp_path / "walked")}, progress=False, checkpoints=False)
    assert all(start is None for start in taken)
    assert (tmp_path / "kept" / "model.safetensors").read_bytes() == \
        (tmp_path / "walked" / "model.safetensors").read_bytes()
    assert kept_walk < sum(walked_layers)
