"""FlattenAdjacent: greedy selection, the parallel-sum merge, config bookkeeping and validation."""
import copy

import pytest
import torch

from recipe_engine.modifiers.flatten_adjacent import FlattenAdjacent, merge_layers, select_blocks, symbolic_blocks
from recipe_engine.architectures.adapters import adapter_for
from recipe_engine.errors import RecipeError
from recipe_engine.recipe.schema import CalibrationConfig
from recipe_engine.execution.context import RunContext
from recipe_engine.execution.session import Session, oversized_layers
from recipe_engine.architectures.shape import ModelShape
from tests.helpers import random_tokens, run_pass, tiny_config, tiny_model


def make_session(model, tokens):
    config = CalibrationConfig(samples=tokens.shape[0], seq_len=tokens.shape[1], batch_size=2)
    return Session(RunContext(None, adapter_for(model.config), config, torch.device("cpu")), model, tokens).view


def hand_similarity(entries: dict, size: int) -> torch.Tensor:
    similarity = torch.eye(size)
    for (i, j), value in entries.items():
        similarity[i, j] = similarity[j, i] = value
    return similarity


def test_greedy_selection_uses_first_row_last_column():
    # pairs: (0,1)=.90 (1,2)=.95 (2,3)=.50 (3,4)=.80; spans: S[0][2]=.85, S[1][3]=.40, S[0][3]=.1
    s = hand_similarity({(0, 1): .90, (1, 2): .95, (2, 3): .50, (3, 4): .80, (0, 2): .85, (1, 3): .40,
                         (0, 3): .10, (2, 4): .30, (1, 4): .2, (0, 4): .05}, 5)
    blocks, scores = select_blocks(s, 1)
    assert blocks == [[0], [1, 2], [3], [4]] and scores == pytest.approx([.95])
    # after merging 1..2, block [0] vs [1,2] is scored by S[0][2] = .85 (not S[0][1] = .90)
    blocks, scores = select_blocks(s, 2)
    assert blocks == [[0, 1, 2], [3], [4]] and scores == pytest.approx([.95, .85])
    # [0,1,2] vs [3] scores S[0][3] = .10 < S[3][4] = .80
    blocks, scores = select_blocks(s, 3)
    assert blocks == [[0, 1, 2], [3, 4]] and scores == pytest.approx([.95, .85, .80])


def test_greedy_ties_go_to_the_lowest_index():
    s = hand_similarity({(0, 1): .7, (1, 2): .7, (2, 3): .7}, 4)
    assert select_blocks(s, 1)[0] == [[0, 1], [2], [3]]


def parallel_layer(layers, x, position_embeddings, mask):
    """h = x + Σ_j Attn_j(norm_j(x)); out = h + Σ_j MLP_j(norm'_j(h)), with the original (unfolded) layers."""
    h = x + sum(layer.self_attn(layer.input_layernorm(x), position_embeddings=position_embeddings,
                                attention_mask=mask)[0] for layer in layers)
    return h + sum(layer.mlp(layer.post_attention_layernorm(h)) for layer in layers)


def causal_mask(length):
    return torch.full((length, length), float("-inf")).triu(1)[None, None]


@pytest.mark.parametrize("model_type,count", [("llama", 2), ("qwen2", 2), ("mistral", 3)])
def test_merged_layer_is_the_parallel_sum(model_type, count):
    model = tiny_model(model_type, attn_implementation="eager")
    originals = [copy.deepcopy(model.model.layers[i]) for i in range(count)]
    merged = merge_layers([model.model.layers[i] for i in range(count)], adapter_for(model.config))
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0))
    position_embeddings = model.model.rotary_emb(x, torch.arange(10)[None].expand(2, -1))
    with torch.no_grad():
        got = merged(x, position_embeddings=position_embeddings, attention_mask=causal_mask(10))
        expected = parallel_layer(originals, x, position_embeddings, causal_mask(10))
    assert merged.self_attn.q_proj.out_features == count * 4 * 16
    assert merged.mlp.down_proj.in_features == count * 96
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if model_type == "qwen2":
        torch.testing.assert_close(merged.self_attn.k_proj.bias,
                                   torch.cat([o.self_attn.k_proj.bias for o in originals]))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_flatten_reproduces_the_parallel_model(model_type):
    """Whole model after FlattenAdjacent equals the original layers run with each merged block in parallel."""
    model = tiny_model(model_type, num_hidden_layers=5, attn_implementation="eager")
    original = copy.deepcopy(model)
    tokens = random_tokens(4, 24)
    session = make_session(model, tokens)
    report = FlattenAdjacent(n=2).apply(session)
    blocks = [g["merged"] for g in report["groups"]]
    blocks = [[i] for i in range(5) if not any(i in b for b in blocks)] + blocks
    blocks.sort()
    with torch.no_grad():
        got = model(tokens).logits
        x = original.model.embed_tokens(tokens)
        position_embeddings = original.model.rotary_emb(x, torch.arange(24)[None].expand(4, -1))
        for block in blocks:
            x = parallel_layer([original.model.layers[i] for i in block], x, position_embeddings, causal_mask(24))
        expected = original.lm_head(original.model.norm(x))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert model.config.num_hidden_layers == 3 == len(model.model.layers)
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2]
    assert session.layer_origin == [tuple(b) for b in blocks]
    assert oversized_layers(session.session) == [i for i, b in enumerate(blocks) if len(b) > 1]
    artifacts = session.outputs.artifacts
    assert "similarity.png" in artifacts and artifacts["similarity.png"][:4] == b"\x89PNG"


def test_similarity_matches_hidden_states():
    model = tiny_model()
    tokens = random_tokens(2, 16)
    session = make_session(model, tokens)
    similarity = FlattenAdjacent(n=1, similarity_tokens=10_000).input_similarity(session)
    with torch.no_grad():
        hidden = model(tokens, output_hidden_states=True).hidden_states[:4]
    for i in range(4):
        for j in range(4):
            cos = torch.nn.functional.cosine_similarity(hidden[i], hidden[j], dim=-1).mean()
            assert similarity[i, j] == pytest.approx(float(cos), abs=1e-5)


def test_check_updates_shape():
    shape = ModelShape.from_config(tiny_config(num_hidden_layers=6))
    FlattenAdjacent(sparsity=0.5).check(shape)
    assert shape.num_layers == 3
    assert [layer.origin for layer in shape.layers] == [(0, 1), (2, 3), (4, 5)]
    assert all((layer.num_heads, layer.num_kv_heads, layer.intermediate_size) == (8, 4, 192)
               for layer in shape.layers)
    assert symbolic_blocks(4, 3) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("params,message", [
    ({"n": 4}, "n resolves to 4 merges of a 4-layer model"),
    ({"target_layers": 4}, "target_layers resolves to 0 merges"),
    ({"n": 2, "sparsity": 0.5}, "give exactly one of n, sparsity, target_layers"),
    ({}, "give exactly one of n, sparsity, target_layers .got none"),
])
def test_check_rejects_bad_counts(params, message):
    with pytest.raises(RecipeError, match=message):
        FlattenAdjacent(**params).check(ModelShape.from_config(tiny_config()))


def test_unit_vector_store_on_disk_equals_in_memory(tmp_path):
    """The scratch-file store (streamed runs) gives bit for bit the in-memory store's S, which equals the
    fp64 brute force Σ_t u_i,t · u_j,t; the file is gone afterwards."""
    from recipe_engine.modifiers.flatten_adjacent import UnitVectorStore

    vectors = torch.nn.functional.normalize(torch.randn(5, 300, 16, generator=torch.Generator().manual_seed(0)),
                                            dim=-1)
    grams = []
    for directory in (None, tmp_path):
        with UnitVectorStore(5, 300, 16, directory, chunk=64) as store:
            for layer in range(5):
                store.write(layer, vectors[layer])
            grams.append(store.cosine_gram())
    assert torch.equal(grams[0], grams[1])
    expected = torch.einsum("ith,jth->ij", vectors.double(), vectors.double())
    torch.testing.assert_close(grams[0].double(), expected, rtol=1e-6, atol=1e-5)
    assert list(tmp_path.iterdir()) == []


def parallel_model_nll(original, blocks, tokens) -> float:
    """Mean next-token NLL of ``original`` with each block of layers run in parallel (``parallel_layer``,
    on the unmodified layers: independent of ``merge_layers``)."""
    batch, length = tokens.shape
    with torch.no_grad():
        x = original.model.embed_tokens(tokens)
        position_embeddings = original.model.rotary_emb(x, torch.arange(length)[None].expand(batch, -1))
        for block in blocks:
            x = parallel_layer([original.model.layers[i] for i in block], x, position_embeddings,
                               causal_mask(length))
        logits = original.lm_head(original.model.norm(x))
        return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                       tokens[:, 1:].reshape(-1)))


def brute_force_merges(original, tokens, merges, drops=False):
    """Greedy over every adjacent pair of blocks (and, with ``drops``, every unmerged layer but the first and
    last, skipped), each candidate model scored by ``parallel_model_nll``; ties: lowest index, merge first."""
    blocks, chosen = [[i] for i in range(original.config.num_hidden_layers)], []
    for _ in range(merges):
        candidates = [(blocks[:j] + [blocks[j] + blocks[j + 1]] + blocks[j + 2:], (j, 0), blocks[j] + blocks[j + 1])
                      for j in range(len(blocks) - 1)]
        if drops:
            candidates += [(blocks[:j] + blocks[j + 1:], (j, 1), [-blocks[j][0]])
                           for j in range(1, len(blocks) - 1) if len(blocks[j]) == 1]
        losses = [parallel_model_nll(original, model_blocks, tokens) for model_blocks, _, _ in candidates]
        best = min(range(len(losses)), key=lambda c: (losses[c], candidates[c][1]))
        chosen.append((candidates[best][2], losses))
        blocks = candidates[best][0]
    return blocks, chosen


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_nll_selection_equals_brute_force_greedy(model_type):
    """Each round's candidates' NLLs and choice equal a brute-force greedy over independently built
    parallel models, scored on the first search_samples × search_length calibration tokens only."""
    model = tiny_model(model_type, num_hidden_layers=6, seed=3, attn_implementation="eager")
    original = copy.deepcopy(model)
    tokens = random_tokens(4, 24, seed=5)
    session = make_session(model, tokens)
    step = FlattenAdjacent(n=3, selection="nll", candidates="merged", search_samples=3, search_length=16,
                           score="insample")
    report = step.apply(session)
    blocks, chosen = brute_force_merges(original, tokens[:3, :16], 3)
    assert [r["merged"] for r in report["rounds"]] == [merged for merged, _ in chosen]
    for record, (_, losses) in zip(report["rounds"], chosen):
        assert list(record["candidates"].values()) == pytest.approx(losses, rel=1e-5)
        assert record["nll"] == pytest.approx(min(losses), rel=1e-5)
    assert session.layer_origin == [tuple(b) for b in blocks]
    assert session.passes.value == step.passes(ModelShape.from_config(original.config))
    assert "similarity" not in report and "similarity.png" not in session.outputs.artifacts
    # the model left behind is the parallel model of the chosen blocks
    with torch.no_grad():
        got = float(model(tokens[:3, :16], labels=tokens[:3, :16]).loss)
    assert got == pytest.approx(parallel_model_nll(original, blocks, tokens[:3, :16]), rel=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_nll_selection_with_drops_equals_brute_force_greedy(model_type):
    """``drops: true``: merges and skips of single layers compete each round; the candidates' NLLs and the
    choices equal the brute-force greedy over independently built models. Layer 2 is made nearly the
    identity (its o_proj and down_proj scaled by 1e-3), so dropping a layer is cheap; on the Llama model both
    moves occur (the random Qwen2 one merges every round, its drop candidates are still compared)."""
    model = tiny_model(model_type, num_hidden_layers=6, seed=3, attn_implementation="eager")
    with torch.no_grad():
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            model.model.layers[2].get_submodule(name).weight.mul_(1e-3)
    original = copy.deepcopy(model)
    tokens = random_tokens(4, 24, seed=5)
    session = make_session(model, tokens)
    report = FlattenAdjacent(n=3, selection="nll", candidates="merged", drops=True, search_samples=3,
                             search_length=16, score="insample").apply(session)
    blocks, chosen = brute_force_merges(original, tokens[:3, :16], 3, drops=True)
    moves = [r["merged"] if "merged" in r else [-r["dropped"][0]] for r in report["rounds"]]
    assert moves == [move for move, _ in chosen]
    dropped = sorted(-m[0] for m in moves if len(m) == 1)
    assert any(len(m) > 1 for m in moves) and (dropped or model_type != "llama")
    for record, (_, losses) in zip(report["rounds"], chosen):
        assert list(record["candidates"].values()) == pytest.approx(losses, rel=1e-5)
    assert report.get("dropped", []) == [[i] for i in dropped] and session.layer_origin == [tuple(b) for b in blocks]
    with torch.no_grad():
        got = float(model(tokens[:3, :16], labels=tokens[:3, :16]).loss)
    assert got == pytest.approx(parallel_model_nll(original, blocks, tokens[:3, :16]), rel=1e-5)


def test_drops_need_nll_selection():
    with pytest.raises(RecipeError, match="drops: true needs selection: nll"):
        FlattenAdjacent(n=1, drops=True).check_calibration(CalibrationConfig(samples=4, seq_len=16, batch_size=2))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_pruned_candidates_equal_the_pipeline_on_each_pair(model_type):
    """``candidates: pruned``, one merge: every pair's score equals the NLL of the model the engine's own
    pipeline builds with that pair merged (FlattenAdjacent's merge, then HeadPrune and NystromMLP<target:
    merged, criterion: energy> in the layer-sequential pass on the probe tokens), scored by HF's forward;
    the choice is the argmin and the model left behind is unpruned, merged at that pair."""
    from recipe_engine.modifiers.head_prune import HeadPrune
    from recipe_engine.modifiers.nystrom_mlp import NystromMLP

    model = tiny_model(model_type, num_hidden_layers=5, seed=7)
    tokens = random_tokens(4, 24, seed=8)
    probe_tokens = tokens[:2, :16]
    expected = []
    for j in range(4):
        reference = copy.deepcopy(model)
        session = make_session(reference, probe_tokens)
        layers = list(session.layers)
        blocks = [[i] for i in range(j)] + [[j, j + 1]] + [[i] for i in range(j + 2, 5)]
        session.set_layers([merge_layers([layers[i] for i in b], session.adapter) if len(b) > 1 else layers[b[0]]
                            for b in blocks], [tuple(b) for b in blocks], [b[0] for b in blocks])
        run_pass(session, [HeadPrune(), NystromMLP(criterion="energy", target="merged")])
        with torch.no_grad():
            expected.append(float(reference(probe_tokens, labels=probe_tokens).loss))
    session = make_session(model, tokens)
    report = FlattenAdjacent(n=1, selection="nll", search_samples=2, search_length=16,
                             score="insample").apply(session)
    assert list(report["rounds"][0]["candidates"].values()) == pytest.approx(expected, rel=1e-5)
    best = min(range(4), key=lambda j: expected[j])
    assert report["rounds"][0]["merged"] == [best, best + 1]
    assert oversized_layers(session.session) == [best]


def test_nll_rounds_are_shared_as_a_prefix():
    """A larger n continues the rounds a smaller n recorded (a sweep over n runs each round once)."""
    from recipe_engine.modifiers.flatten_adjacent import select_blocks_by_nll

    model = tiny_model(num_hidden_layers=5, seed=4)
    session = make_session(model, random_tokens(2, 16, seed=6))
    rounds: list = []
    blocks_one, _ = select_blocks_by_nll(session, 1, rounds, pruned=False)
    first = dict(rounds[0])
    runs = session.session.work.runs
    blocks_two, rounds_two = select_blocks_by_nll(session, 2, rounds, pruned=False)
    assert rounds_two[0] == first and len(rounds_two) == 2
    # round 2 alone: one prefix walk (≤ 4 block runs) plus the candidates' suffixes, not round 1 again
    assert session.session.work.runs - runs <= 4 + sum(range(1, 5))
    fresh, _ = select_blocks_by_nll(make_session(copy.deepcopy(model), random_tokens(2, 16, seed=6)), 2,
                                    pruned=False)
    assert fresh == blocks_two


@pytest.mark.parametrize("params,field", [({"search_samples": 5}, "search_samples"),
                                          ({"search_length": 32}, "search_length")])
def test_nll_selection_rejects_a_probe_larger_than_the_calibration(params, field):
    with pytest.raises(RecipeError, match=field):
        FlattenAdjacent(n=1, selection="nll", **params).check_calibration(
            CalibrationConfig(samples=4, seq_len=16, batch_size=2))
