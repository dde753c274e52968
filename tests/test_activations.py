"""The activation store (``recipe_engine.execution.activations``): what a pass's activations are and how one
layer runs over them, checked against plain torch."""
import pytest
import torch

from recipe_engine.execution.activations import Activations, keep, load
from tests.baselines_helpers import make_session
from tests.helpers import random_tokens, tiny_model


def _store(batches: int = 3, storage: str = "cpu") -> Activations:
    states = [torch.randn(2, 5, 4) for _ in range(batches)]
    kwargs = [{"position_embeddings": (torch.ones(2, 5, 2) * k, torch.zeros(2, 5, 2)), "flag": k}
              for k in range(batches)]
    windows = [torch.randint(0, 9, (2, 5)) for _ in range(batches)]
    return Activations(states, kwargs, windows, torch.device(storage))


def test_capture_holds_layer_zero_inputs_with_their_windows():
    """The capture's states are the model's own hidden states entering layer 0, its windows the session's
    batches, and one layer run over it gives the model's hidden states after layer 0."""
    model = tiny_model()
    tokens = random_tokens(4, 24)
    expected = model(tokens, output_hidden_states=True).hidden_states
    session = make_session(model, tokens)
    captured = session.capture_inputs()
    assert len(captured) == 2 and captured.tokens == tokens.numel() and captured.storage == torch.device("cpu")
    assert all(torch.equal(w, b) for w, b in zip(captured.windows, tokens.split(2)))
    torch.testing.assert_close(torch.cat(captured.states), expected[0], rtol=0, atol=0)
    after = session.run_layer(session.layers[0], captured)
    assert after.kwargs == captured.kwargs and after.windows == captured.windows
    torch.testing.assert_close(torch.cat(after.states), expected[1], rtol=1e-5, atol=1e-5)


def test_run_visits_the_given_batches_in_order_and_skips_stopped_ones():
    store = _store(4)
    layer = torch.nn.Linear(4, 4)
    seen, after = [], []

    class Stop(Exception):
        pass

    def forward(x, position_embeddings, flag):
        if flag == 2:
            raise Stop
        return (layer(x) + position_embeddings[0].sum(), None)

    outputs = store.run(forward, torch.device("cpu"), [3, 1, 2], before=lambda p, k: seen.append((p, k)),
                        after=lambda n, out: after.append(n), stops=(Stop,))
    assert seen == [(0, 3), (1, 1), (2, 2)] and after == [0, 1]
    expected = [layer(store.states[k]) + store.kwargs[k]["position_embeddings"][0].sum() for k in (3, 1)]
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_replace_keeps_kwargs_and_windows_and_checks_the_count():
    store = _store(3)
    new = store.replace([s * 2 for s in store.states])
    assert new.kwargs is not store.kwargs and new.kwargs == store.kwargs and new.windows == store.windows
    assert torch.equal(new[1], store[1] * 2) and list(store) == store.states
    with pytest.raises(ValueError, match="2 batches given, 3 expected"):
        store.replace(store.states[:2])
    with pytest.raises(ValueError, match="one each per batch"):
        Activations(store.states, store.kwargs[:1], store.windows, store.storage)


def test_copy_is_new_lists_around_the_same_tensors():
    store = _store(2)
    copied = store.copy()
    copied.states[0] = torch.zeros(1)
    copied.kwargs[1]["flag"] = 99
    assert store.states[0].shape == (2, 5, 4) and store.kwargs[1]["flag"] == 1
    assert copied.states[1] is store.states[1] and copied.meter is store.meter
    meter = lambda tensor, target: None
    assert store.copy(meter).meter is meter


def test_moves_count_their_bytes_and_keep_nesting():
    """``load``/``keep`` move every tensor of a nested value, count the bytes that cross between host and
    device, and leave a tensor already in place as it is (no copy)."""
    moved = []
    meter = lambda tensor, target: moved.append((tuple(tensor.shape), target.type))
    value = {"pair": (torch.ones(2), torch.zeros(3)), "mask": torch.ones(1), "flag": 3}
    on_meta = load(value, torch.device("meta"), meter)
    assert [t.device.type for t in on_meta["pair"]] == ["meta", "meta"] and on_meta["flag"] == 3
    assert moved == [((2,), "meta"), ((3,), "meta"), ((1,), "meta")]
    host = torch.ones(4)
    assert keep(host, torch.device("cpu")) is host and load(host, torch.device("cpu")) is host
    store = _store(2)
    pick = lambda kw: {"position_embeddings": kw["position_embeddings"]}
    x, kwargs = store.batch(1, torch.device("meta"), kwargs_of=pick)
    assert x.device.type == "meta" and set(kwargs) == {"position_embeddings"}
    assert [t.device.type for t in store.on(torch.device("meta"))] == ["meta", "meta"]


class RecordedCopies:
    """A copy stream that records when each batch's copy is issued and made ready (CopyStream's calls)."""

    def __init__(self, events: list):
        self.events = events

    def issue(self, fetch):
        value = fetch()
        self.events.append(("issue", int(value[0][0, 0, 0].item()) if isinstance(value, tuple)
                            else int(value[0, 0, 0].item())))
        return value

    def ready(self, value):
        self.events.append(("ready", int(value[0][0, 0, 0].item()) if isinstance(value, tuple)
                            else int(value[0, 0, 0].item())))


def test_prefetch_issues_the_next_batch_before_the_current_one_computes():
    """With a copy stream, batch k + 1's copy is issued before batch k's forward, each batch is made ready
    before it is read, and the outputs are those of the plain loop."""
    store = _store(4)
    for k, state in enumerate(store.states):
        state[0, 0, 0] = k  # the batch's number, read back by RecordedCopies
    events = []
    layer = torch.nn.Linear(4, 4)
    layer.register_forward_pre_hook(lambda _m, args: events.append(("forward", int(args[0][0, 0, 0].item()))))
    ahead = store.run(layer, torch.device("cpu"), [0, 2, 3], kwargs_of=lambda _kwargs: {},
                      copies=RecordedCopies(events))
    assert events == [("issue", 0), ("ready", 0), ("issue", 2), ("forward", 0), ("ready", 2), ("issue", 3),
                      ("forward", 2), ("ready", 3), ("forward", 3)]
    plain = store.run(layer, torch.device("cpu"), [0, 2, 3], kwargs_of=lambda _kwargs: {})
    assert all(torch.equal(a, b) for a, b in zip(ahead, plain, strict=True))
    events.clear()
    assert [int(s[0, 0, 0]) for s in store.on(torch.device("cpu"), [1, 3])] == [1, 3]
    assert events == []  # no copy stream between host storage and the host


def test_a_copy_stream_only_between_host_storage_and_cuda():
    from recipe_engine.execution.activations import CopyStream
    assert CopyStream.between(torch.device("cpu"), torch.device("cpu")) is None
    assert CopyStream.between(torch.device("cpu"), torch.device("meta")) is None
    assert CopyStream.between(torch.device("cuda", 0), torch.device("cuda", 0)) is None
