"""Choices by held-out loss: the fit / score window split, FlattenAdjacent's ``score: heldout`` search, the
BestOf step (each checked against brute force: independent runs scored on the same windows) and layer
budgets given as a percentage of the model's layers."""
import copy
import json

import pytest
import torch
from rich.console import Console

import recipe_engine
from recipe_engine.cli.summary import print_summary
from recipe_engine.recipe.budget import bind_step, resolve_budget
from recipe_engine.errors import RecipeError
from recipe_engine.modifiers.flatten_adjacent import FlattenAdjacent, merge_layers
from recipe_engine.modifiers.head_prune import HeadPrune
from recipe_engine.modifiers.nystrom_mlp import NystromMLP
from recipe_engine.execution.steps import run_steps
from recipe_engine.system.progress import Progress
from recipe_engine.recipe.schema import parse_step, recipe_from_dict
from recipe_engine.execution.modifier_view import ModifierView
from recipe_engine.execution.pipeline import LayerPipeline
from recipe_engine.architectures.shape import ModelShape
from recipe_engine.recipe.split import heldout_split
from recipe_engine.plan.preflight import check_against_config
from tests.baselines_helpers import make_session
from tests.helpers import BYTE_VOCAB, byte_tokenizer, random_tokens, run_pass, tiny_config, tiny_model


# -- the split ---------------------------------------------------------------------------------
def test_heldout_split_follows_the_documented_rule():
    for samples, fraction, seed in [(32, 0.25, 0), (8, 0.25, 3), (5, 0.5, 1), (2, 0.9, 0)]:
        split = heldout_split(samples, seed, fraction)
        count = min(samples - 1, max(1, int(fraction * samples + 0.5)))
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed)).tolist()
        assert list(split.score) == sorted(order[:count])
        assert sorted(split.fit + split.score) == list(range(samples)) and not set(split.fit) & set(split.score)
    assert heldout_split(32, 0) == heldout_split(32, 0) and heldout_split(32, 0) != heldout_split(32, 1)
    with pytest.raises(ValueError, match="at least 2"):
        heldout_split(1, 0)


# -- FlattenAdjacent<selection: nll, score: heldout> -------------------------------------------------
def pruned_candidate_nll(original, blocks, fit_tokens, score_tokens) -> float:
    """The model with ``blocks`` (dropped layers absent) built independently: merged blocks merged, then
    pruned back by the engine's layer-sequential pipeline (HeadPrune, NystromMLP<energy, merged>) on the fit
    tokens only; scored by HF's forward on the score tokens."""
    model = copy.deepcopy(original)
    session = make_session(model, fit_tokens)
    layers = list(session.layers)
    session.set_layers([merge_layers([layers[i] for i in b], session.adapter) if len(b) > 1 else layers[b[0]]
                        for b in blocks], [tuple(b) for b in blocks], [b[0] for b in blocks])
    if any(len(b) > 1 for b in blocks):
        run_pass(session, [HeadPrune(), NystromMLP(criterion="energy", target="merged")])
    with torch.no_grad():
        return float(model(score_tokens, labels=score_tokens).loss)


def brute_force_heldout(original, fit_tokens, score_tokens, rounds):
    """Greedy over every merge of adjacent blocks and every drop of an unmerged inner layer, each candidate
    built and scored by ``pruned_candidate_nll``; ties: lowest index, merge first."""
    blocks, chosen = [[i] for i in range(original.config.num_hidden_layers)], []
    for _ in range(rounds):
        candidates = [(blocks[:j] + [blocks[j] + blocks[j + 1]] + blocks[j + 2:], (j, 0), blocks[j] + blocks[j + 1])
                      for j in range(len(blocks) - 1)]
        candidates += [(blocks[:j] + blocks[j + 1:], (j, 1), [-blocks[j][0]])
                       for j in range(1, len(blocks) - 1) if len(blocks[j]) == 1]
        losses = [pruned_candidate_nll(original, b, fit_tokens, score_tokens) for b, _, _ in candidates]
        best = min(range(len(losses)), key=lambda c: (losses[c], candidates[c][1]))
        chosen.append((candidates[best][2], losses))
        blocks = candidates[best][0]
    return blocks, chosen


def test_heldout_search_equals_brute_force_on_the_score_windows(monkeypatch):
    """``selection: nll, drops: true, score: heldout``: each round's candidates (merges pruned on the fit
    windows, drops) score what independently built models score on the score windows, the moves equal the
    brute-force greedy's, and every prune saw fit windows only while every score saw score windows only."""
    from recipe_engine.modifiers import flatten_adjacent

    model = tiny_model(num_hidden_layers=5, seed=3, attn_implementation="eager")
    with torch.no_grad():  # layer 2 nearly the identity: a drop is a real contender
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            model.model.layers[2].get_submodule(name).weight.mul_(1e-2)
    original = copy.deepcopy(model)
    tokens = random_tokens(8, 24, seed=5)
    step = FlattenAdjacent(n=2, selection="nll", drops=True, search_samples=2, search_length=16)
    split = heldout_split(8, 0, step.score_fraction)
    fit_tokens, score_tokens = tokens[list(split.fit[:2]), :16], tokens[list(split.score[:2]), :16]

    fitted_on, scored_on = [], []
    real_prune, real_nll = flatten_adjacent.prune_to_config, LayerPipeline.final_nll
    monkeypatch.setattr(flatten_adjacent, "prune_to_config", lambda probe, *args: (
        fitted_on.append(probe.calibration.clone()), real_prune(probe, *args))[1])
    monkeypatch.setattr(LayerPipeline, "final_nll", lambda self, finals, *args: (
        scored_on.append(self.session.calibration.clone()), real_nll(self, finals, *args))[1])
    session = make_session(model, tokens)
    report = step.apply(session)
    monkeypatch.undo()

    assert fitted_on and all(torch.equal(t, fit_tokens) for t in fitted_on)
    assert scored_on and all(torch.equal(t, score_tokens) for t in scored_on)
    assert report["search"] == {"score": "heldout", "score_windows": list(split.score[:2]),
                                "fit_windows": list(split.fit[:2]), "tokens_per_window": 16}
    blocks, chosen = brute_force_heldout(original, fit_tokens, score_tokens, 2)
    moves = [r["merged"] if "merged" in r else [-r["dropped"][0]] for r in report["rounds"]]
    assert moves == [move for move, _ in chosen]
    for record, (_, losses) in zip(report["rounds"], chosen):
        assert list(record["candidates"].values()) == pytest.approx(losses, rel=1e-4)
    assert session.passes.value == step.passes(ModelShape.from_config(original.config)) == 4


# -- BestOf -----------------------------------------------------------------------------------------
ALTERNATIVES = [["ShortGPT<n:2>"], ["SLEB<n:2>"], ["ShortGPT<n:2>", "LinearPatch"],
                ["FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP"]]


def standalone(original, steps, fit_tokens, score_tokens):
    """One alternative run alone on a fresh copy over the fit windows (its own session and reference), scored
    by HF's forward (with any patch hooks) on the score windows."""
    model = copy.deepcopy(original)
    session = make_session(model, fit_tokens)
    run_steps(session.session, [parse_step(s, i) for i, s in enumerate(steps)], Progress(enabled=False))
    with torch.no_grad():
        return model, float(model(score_tokens, labels=score_tokens).loss)


def window_losses(model, tokens) -> list[float]:
    """HF's loss on each window alone."""
    with torch.no_grad():
        return [float(model(w[None], labels=w[None]).loss) for w in tokens]


def paired_mean_and_error(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of the per-window differences a − b and its standard error (sample standard deviation / √n)."""
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    return mean, (sum((x - mean) ** 2 for x in d) / (len(d) - 1)) ** 0.5 / len(d) ** 0.5


@pytest.mark.parametrize("refit", [False, True])
def test_best_of_equals_the_alternatives_run_alone(monkeypatch, refit):
    """BestOf's scores equal each alternative run alone on the fit windows and scored on the score windows,
    its choice is their argmin, and the model it leaves computes what the winner's standalone run does: on
    the fit windows (``refit: false``) or on all the windows (``refit: true``). Every calibration walk
    (captures of the alternatives' own steps, their reference model's, the scoring, the refit) is
    instrumented: before the choice the score windows are walked exactly once per alternative, to score it;
    the only walks over all the windows are the refit's, after every score."""
    model = tiny_model(num_hidden_layers=6, seed=1)
    original = copy.deepcopy(model)
    tokens = random_tokens(8, 32, seed=2)
    step = parse_step({"BestOf": {"alternatives": ALTERNATIVES, "refit": refit}}, 0)
    session = make_session(model, tokens)
    walked = []
    capture = LayerPipeline.capture_inputs
    monkeypatch.setattr(LayerPipeline, "capture_inputs", lambda self: (walked.append(self.session.calibration.clone()),
                                                                       capture(self))[1])
    report = step.apply(session)
    monkeypatch.undo()
    split = heldout_split(8, 0)
    fit_tokens, score_tokens = tokens[list(split.fit)], tokens[list(split.score)]
    kinds = ["score" if torch.equal(w, score_tokens) else "fit" if torch.equal(w, fit_tokens)
             else "all" if torch.equal(w, tokens) else "other" for w in walked]
    assert kinds.count("score") == len(ALTERNATIVES) and "other" not in kinds
    last_score = max(i for i, kind in enumerate(kinds) if kind == "score")
    assert all(kind == "all" for kind in kinds[last_score + 1:]) and "all" not in kinds[:last_score]
    assert ("all" in kinds) == refit
    assert report["score"]["fit_windows"] == list(split.fit) and report["score"]["score_windows"] == list(split.score)
    runs = [standalone(original, steps, fit_tokens, score_tokens) for steps in ALTERNATIVES]
    assert [r["nll"] for r in report["alternatives"]] == pytest.approx([nll for _, nll in runs], rel=1e-5)
    winner = min(range(len(runs)), key=lambda a: (runs[a][1], a))
    assert report["chosen"] == winner
    # per-window NLLs: HF's loss window by window; margins: the paired mean and standard error by hand
    windows = [window_losses(m, score_tokens) for m, _ in runs]
    for record, expected_windows in zip(report["alternatives"], windows):
        assert record["window_nlls"] == pytest.approx(expected_windows, rel=1e-5)
    margins = {a: paired_mean_and_error(windows[a], windows[winner]) for a in range(len(runs)) if a != winner}
    for a, (mean, error) in margins.items():
        assert report["alternatives"][a]["margin"] == pytest.approx({"nats": mean, "standard_error": error},
                                                                    rel=1e-4, abs=1e-6)
    runner_up = min(margins, key=lambda a: margins[a][0])
    assert report["runner_up"]["alternative"] == runner_up and "margin" not in report["alternatives"][winner]
    assert [r["layers"] for r in report["alternatives"]] == [4] * 4 and len(session.layers) == 4
    assert all(r["records"][0]["modifier"] == parse_step(ALTERNATIVES[a][0], 0).step_name()
               for a, r in enumerate(report["alternatives"]))
    expected = standalone(original, ALTERNATIVES[winner], tokens, score_tokens)[0] if refit else runs[winner][0]
    assert (report["refit"] is not None) == refit
    if refit:
        assert report["refit"]["windows"] == 8
        assert [r["modifier"] for r in report["refit"]["records"]] == [r["modifier"] for r in
                                                                       report["alternatives"][winner]["records"]]
    probe = random_tokens(2, 32, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(probe).logits, expected(probe).logits, rtol=1e-5, atol=1e-5)
    expected_state = expected.state_dict()
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in expected_state.items()}
    assert all(torch.equal(v, expected_state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("within", [1.0, 1000.0])
def test_prefer_earlier_within_picks_the_first_alternative_within_k_standard_errors(within):
    """``prefer_earlier_within: k`` chooses what a by-hand rule over the alternatives run alone chooses: the
    first listed whose mean per-window margin over the lowest score is at most k paired standard errors;
    without a refit the model kept is that alternative's own on the fit windows, built again."""
    model = tiny_model(num_hidden_layers=6, seed=1)
    original = copy.deepcopy(model)
    tokens = random_tokens(8, 32, seed=2)
    step = parse_step({"BestOf": {"alternatives": ALTERNATIVES, "refit": False,
                                  "score": {"prefer_earlier_within": within}}}, 0)
    report = step.apply(make_session(model, tokens))
    split = heldout_split(8, 0)
    fit_tokens, score_tokens = tokens[list(split.fit)], tokens[list(split.score)]
    runs = [standalone(original, steps, fit_tokens, score_tokens) for steps in ALTERNATIVES]
    windows = [window_losses(m, score_tokens) for m, _ in runs]
    lowest = min(range(len(runs)), key=lambda a: (runs[a][1], a))

    def within_k(a):
        mean, error = paired_mean_and_error(windows[a], windows[lowest])
        return mean <= within * error

    expected = next(a for a in range(len(runs)) if a == lowest or within_k(a))
    assert (report["lowest"], report["chosen"]) == (lowest, expected)
    if within == 1000.0:
        assert expected != lowest  # the rule is exercised: an earlier alternative replaces the lowest
    assert report["nll"] == pytest.approx(runs[expected][1], rel=1e-5)
    probe = random_tokens(2, 32, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(probe).logits, runs[expected][0](probe).logits, rtol=1e-5, atol=1e-5)
    if expected != lowest:
        assert "above the lowest" in report["headline"] and f"alternative {lowest}" in report["headline"]


def test_best_of_frees_each_losing_copy_before_the_next_alternative_copies_the_model(monkeypatch):
    """Peak memory is two copies of the model beyond the session's own (the running alternative and the best
    so far): when an alternative's copy is made, every earlier copy but the best so far is gone, even with
    the cyclic garbage collector off; before the refit's copy, the best one is gone too."""
    import gc
    import weakref

    model = tiny_model(num_hidden_layers=5, seed=1)
    step = parse_step({"BestOf": {"alternatives": [["ShortGPT<n:1>"], ["SLEB<n:1>"],
                                                   ["ShortGPT<n:1>", "LinearPatch"]]}}, 0)
    copies, alive_at_copy = [], []
    real_branch = ModifierView.branch

    def branch(self, calibration, steps=(), *, copy=True, memo=None):
        if not copy:
            return real_branch(self, calibration, copy=False, memo=memo)
        alive_at_copy.append(sum(ref() is not None for ref in copies))
        made = real_branch(self, calibration, steps, memo=memo)
        copies.append(weakref.ref(made.model))
        return made

    monkeypatch.setattr(ModifierView, "branch", branch)
    gc.disable()
    try:
        step.apply(make_session(model, random_tokens(8, 16, seed=2)))
    finally:
        gc.enable()
    assert alive_at_copy[0] == 0 and all(alive <= 1 for alive in alive_at_copy[1:-1]) and alive_at_copy[-1] == 0
    assert len(alive_at_copy) == 4  # three alternatives and the refit


def test_best_of_shares_the_captures_between_alternatives():
    model = tiny_model(num_hidden_layers=5, seed=1)
    step = parse_step({"BestOf": {"alternatives": [["ShortGPT<n:1>"], ["ShortGPT<n:1>", "LinearPatch"]]}}, 0)
    result = step.apply(make_session(model, random_tokens(8, 16, seed=2)))
    # ShortGPT's scores computed once for both; the fit capture and the score capture taken once each
    assert result["shared_work"]["computed"] == {"calibration capture": 2, "ShortGPT block influence": 1}
    assert result["shared_work"]["reused"]["ShortGPT block influence"] == 1


def recipe(tmp_path, modifiers, **extra):
    (tmp_path / "cal.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    return {"version": 1, "name": "best", "model": "tiny-in-memory", "output": str(tmp_path / "out"),
            "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 8, "seq_len": 32, "batch_size": 2},
            "modifiers": modifiers, **extra}


def test_best_of_in_a_recipe_skips_a_refused_alternative_and_reports_every_score(tmp_path):
    """On Gemma 3 the engine refuses FlattenAdjacent: BestOf skips it with the reason recorded, chooses
    among the rest, and report.json holds every score, their records, the split and the choice; the next
    step runs on the winner."""
    model = tiny_model("gemma3_text", num_hidden_layers=6, vocab_size=BYTE_VOCAB)
    steps = [{"BestOf": {"alternatives": [["FlattenAdjacent<n:20%>", "HeadPrune", "NystromMLP"],
                                          ["SLEB<n:20%>"], ["ShortGPT<n:20%>"]]}}, "GPTQ<bits:4,group_size:16>"]
    _, report = recipe_engine.apply(recipe(tmp_path, steps), model=model, tokenizer=byte_tokenizer(),
                                    progress=False)
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    result = saved["steps"][0]["result"]
    assert "normalizes each layer's attention and MLP output" in result["alternatives"][0]["refused"]
    scored = result["alternatives"][1:]
    assert all(r["nll"] > 0 and r["records"] for r in scored)
    assert result["chosen"] == min((1, 2), key=lambda a: (result["alternatives"][a]["nll"], a))
    assert saved["steps"][0]["params"]["alternatives"][1] == [{"SLEB": {"n": 1, "search_samples": None,
                                                                         "search_length": None}}]
    assert saved["after"]["layers"] == 5 and saved["steps"][1]["modifier"] == "GPTQ"
    assert saved["stock_checkpoint"] is True  # the winner added no extra
    loser = 3 - result["chosen"]
    margin = result["alternatives"][loser]["margin"]
    assert result["runner_up"]["alternative"] == loser and margin["nats"] >= 0
    console = Console(record=True, width=300)
    print_summary(report, console)
    assert (f"chose alternative {result['chosen']} {result['chosen_steps']}, score-window NLL {result['nll']:.4f}, "
            f"by {margin['nats']:.4f} nats (paired standard error {margin['standard_error']:.4f}) over "
            f"alternative {loser}") in console.export_text()
    refuse = recipe(tmp_path, [{"BestOf": {"refused": "fail", "alternatives": steps[0]["BestOf"]["alternatives"]}}])
    with pytest.raises(RecipeError, match=r"step 0 \(BestOf\): field 'alternatives.0': alternative 0 "
                                          r"\[FlattenAdjacent<n:1>, HeadPrune, NystromMLP\]"):
        check_against_config(recipe_from_dict(refuse), model.config)


def test_an_alternative_equal_to_an_earlier_one_at_this_budget_runs_once(tmp_path):
    """``ShortGPT<n:20%>`` of 5 layers is ``ShortGPT<n:1>``: BestOf records it as the same as the first, does
    not run or score it, plans no passes for it, and validation says so."""
    model = tiny_model(num_hidden_layers=5, vocab_size=BYTE_VOCAB)
    steps = [{"BestOf": {"alternatives": [["ShortGPT<n:1>"], ["SLEB<n:1>"], ["ShortGPT<n:20%>"]]}}]
    spec = recipe(tmp_path, steps)
    shape = check_against_config(recipe_from_dict(spec), model.config)
    assert shape.notes == ["BestOf runs alternative 2 [ShortGPT] once: the same steps as alternative 0"]
    _, report = recipe_engine.apply(spec, model=model, tokenizer=byte_tokenizer(), progress=False)
    result = report.steps[0].result
    assert result["alternatives"][2] == {"alternative": 2, "steps": "[ShortGPT]", "same_as": 0}
    (tmp_path / "twice").mkdir()
    twice = recipe(tmp_path / "twice", [{"BestOf": {"alternatives": [["ShortGPT<n:1>"], ["SLEB<n:1>"]]}}])
    _, without = recipe_engine.apply(twice, model=tiny_model(num_hidden_layers=5, vocab_size=BYTE_VOCAB),
                                     tokenizer=byte_tokenizer(), progress=False)
    assert report.calibration_passes == without.calibration_passes


@pytest.mark.parametrize("alternatives,message", [
    ([["ShortGPT<n:2>"], ["SLEB<n:3>"]], r"alternative 1 \[SLEB<n:3>\] leaves 3 layers .* alternative 0 4"),
    ([["ShortGPT<n:2>"], ["SLEB<m:3>"]],
     r"^step 0 \(BestOf\): field 'alternatives.1.0.m': alternative 1, step 0 \(SLEB\): unknown field"),
    ([["ShortGPT<n:2>"], ["Nope"]],
     r"^step 0 \(BestOf\): field 'alternatives.1.0': alternative 1, step 0: unknown modifier 'Nope'"),
    ([["ShortGPT<n:2>"], "oops"], r"alternative 1, step 0: unknown modifier 'oops'"),
    ([["ShortGPT<n:2>"], [[]]], r"alternative 1, step 0: a step is"),
    ([["ShortGPT<n:2>"]], r"at least 2 items"),
    ([["ShortGPT<n:2>"], ["SLEB<n:2,search_samples:7>"]], r"search_samples=7 exceeds calibration.samples=6"),
])
def test_best_of_validation_errors_are_one_line(tmp_path, alternatives, message):
    """Every alternative is parsed and checked before weights load; an error is one located line."""
    config = tiny_config(num_hidden_layers=6)
    with pytest.raises(RecipeError, match=message) as caught:
        check_against_config(recipe_from_dict(recipe(tmp_path, [{"BestOf": {"alternatives": alternatives}}])),
                             config, "r.yaml")
    assert "\n" not in str(caught.value)


def test_best_of_refuses_a_streamed_run_before_loading(tmp_path):
    from tests.helpers import save_tiny_model

    save_tiny_model(tmp_path / "model", num_hidden_layers=4)
    byte_tokenizer().save_pretrained(tmp_path / "model")
    spec = recipe(tmp_path, [{"BestOf": {"alternatives": [["ShortGPT<n:1>"], ["SLEB<n:1>"]]}}], stream="on")
    spec["model"] = str(tmp_path / "model")
    with pytest.raises(RecipeError, match=r"step 0 \(BestOf\): field 'stream': cannot run streamed: BestOf runs"):
        recipe_engine.apply(spec, progress=False)
    assert not (tmp_path / "out").exists()


def test_best_of_dumps_and_reloads_losslessly(tmp_path):
    loaded = recipe_from_dict(recipe(tmp_path, [{"BestOf": {"alternatives": ALTERNATIVES}}]))
    from recipe_engine.recipe.schema import dump_recipe, load_yaml

    again = recipe_from_dict(load_yaml(dump_recipe(loaded)))
    assert again.modifiers == loaded.modifiers and dump_recipe(again) == dump_recipe(loaded)


# -- budgets as a percentage of layers ----------------------------------------------------------
def test_percent_budget_rounds_half_up_against_the_original_layers():
    assert [resolve_budget("20%", layers) for layers in (30, 24, 18)] == [6, 5, 4]
    assert resolve_budget("25%", 30) == 8 and resolve_budget("12.5%", 4) == 1 and resolve_budget(3, 30) == 3
    step = bind_step(parse_step("SLEB<n:20%>", 0), 24)
    assert step.n == 5 and parse_step("SLEB<n:20%>", 0).n == "20%"
    nested = bind_step(parse_step({"BestOf": {"alternatives": [["SLEB<n:20%>"], ["ShortGPT<n:5>"]]}}, 0), 24)
    assert nested.alternatives[0][0].n == 5
    for bad in ("20", "0%", "100%", "x%", 0):
        with pytest.raises(RecipeError, match="field 'n'"):
            parse_step({"ShortGPT": {"n": bad}}, 0)


@pytest.mark.parametrize("name", ["SLEB", "ShortGPT", "FlattenAdjacent", "LinearPatch"])
def test_percent_budget_validates_and_runs_like_the_count(tmp_path, name):
    """``n: 20%`` on a 10-layer model is ``n: 2``: the same validated shape, and the run records the count."""
    steps = {"SLEB": ["SLEB<n:20%>"], "ShortGPT": ["ShortGPT<n:20%>"], "LinearPatch":
             ["LinearPatch<select:contiguous,n:20%>"],
             "FlattenAdjacent": ["FlattenAdjacent<n:20%>", "HeadPrune", "NystromMLP"]}[name]
    config = tiny_config(num_hidden_layers=10)
    shape = check_against_config(recipe_from_dict(recipe(tmp_path, steps)), config)
    counted = [s.replace("20%", "2") for s in steps]
    assert shape.num_layers == check_against_config(recipe_from_dict(recipe(tmp_path, counted)), config).num_layers == 8
    if name in ("SLEB", "ShortGPT"):
        _, report = recipe_engine.apply(recipe(tmp_path, steps),
                                        model=tiny_model(num_hidden_layers=10, vocab_size=BYTE_VOCAB),
                                        tokenizer=byte_tokenizer(), progress=False, write=False)
        assert report.steps[0].params["n"] == 2 and report.after.layers == 8
    tiny = tiny_config(num_hidden_layers=3)
    with pytest.raises(RecipeError, match=r"step 0 .*field 'n': 10% of 3 layers rounds to 0"):
        check_against_config(recipe_from_dict(recipe(tmp_path, [s.replace("20%", "10%") for s in steps])), tiny)


def test_depth20_auto_validates_on_every_shipped_model_config():
    """The auto recipe moves to each shipped model by --model alone: 20 % of 30 / 24 / 18 layers. Qwen2.5-0.5B
    and Gemma-3-270M: their published configs (reading them from the builtin GGUFs takes ~30 s each); on
    Gemma 3 the FlattenGPT alternatives are refused and skipped, the others validate (ReplaceMe<fold: auto>
    as a hook)."""
    from pathlib import Path

    from transformers import Gemma3TextConfig, Qwen2Config

    from recipe_engine.sources.models import load_config
    from recipe_engine.recipe.files import load_recipe

    configs = {
        "qwen2.5-0.5b": lambda: Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                            num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                            tie_word_embeddings=True),
        "gemma3-270m": lambda: Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                                num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                                vocab_size=262144, sliding_window=512),
        "smollm2-135m": lambda: load_config("smollm2-135m")}
    path = Path(__file__).resolve().parents[1] / "recipes" / "depth20_auto.yaml"
    for model, layers in [("qwen2.5-0.5b", 19), ("gemma3-270m", 14), ("smollm2-135m", 24)]:
        try:
            config = configs[model]()
        except RecipeError as exc:
            pytest.skip(f"{model}: {exc.detail}")
        recipe = load_recipe(str(path), [f"model={model}"]).recipe
        shape = check_against_config(recipe, config)
        assert shape.num_layers == layers
        # what validate prints under its verdict: the alternatives this architecture refuses, with the reason
        # (ReplaceMe then FlattenGPT at two splits, refused at their first step, whose map goes into
        # down_proj; FlattenGPT)
        skipped = ["ReplaceMe", "ReplaceMe", "FlattenAdjacent"] if model == "gemma3-270m" else []
        assert [next(name for name in ("FlattenAdjacent", "ReplaceMe") if f"({name})" in note)
                for note in shape.notes] == skipped
        # exported to GGUF: the LinearPatch alternatives (an extra beside the checkpoint) are skipped too, and on
        # Gemma 3 ReplaceMe<fold: auto> (a hook there; folded into down_proj elsewhere)
        exported = check_against_config(load_recipe(str(path), [f"model={model}", "export={format: gguf}"]).recipe,
                                        config)
        stock = [note.split(": ")[1].split(" would")[0] for note in exported.notes
                 if "would leave a checkpoint that is not stock" in note]
        assert stock == ["LinearPatch", "LinearPatch"] + (["ReplaceMe"] if model == "gemma3-270m" else [])
        assert len(exported.notes) == len(skipped) + len(stock)


def test_a_recipe_that_exports_chooses_only_among_stock_alternatives(tmp_path):
    """With ``export:`` the result must be a stock checkpoint: on Gemma 3, ReplaceMe<fold: auto> keeps its map
    as a hook (not stock), so BestOf skips it with the reason, at validation and in the run, and chooses
    among the rest; without ``export:`` the same alternative runs."""
    model = tiny_model("gemma3_text", num_hidden_layers=6, vocab_size=BYTE_VOCAB)
    steps = [{"BestOf": {"alternatives": [["ReplaceMe<n:1,fold:auto>"], ["ShortGPT<n:1>"]]}}]
    exported = recipe(tmp_path, steps, export={"format": "gguf"})
    shape = check_against_config(recipe_from_dict(exported), model.config)
    assert len(shape.notes) == 1 and "ReplaceMe would leave a checkpoint that is not stock" in shape.notes[0]
    _, report = recipe_engine.apply(exported, model=copy.deepcopy(model), tokenizer=byte_tokenizer(),
                                    write=False, progress=False)
    result = report.steps[0].result
    assert "not stock, and the recipe exports it" in result["alternatives"][0]["refused"]
    assert result["chosen"] == 1
    _, free = recipe_engine.apply(recipe(tmp_path, steps), model=copy.deepcopy(model), tokenizer=byte_tokenizer(),
                                  write=False, progress=False)
    assert "refused" not in free.steps[0].result["alternatives"][0]


def test_best_of_scores_by_a_generation_tasks_heldout_problems():
    """``score.task``: each alternative generates the task's last problems (greedy, checked in the sandbox)
    and its failures are recorded per problem; a random tiny model passes none, so the first listed wins."""
    model = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=6, seed=1)
    step = parse_step({"BestOf": {"alternatives": [["ShortGPT<n:2>"], ["SLEB<n:2>"]], "score": {
        "task": "humaneval", "problems": 2, "max_new_tokens": 4, "allow_code_execution": True}}}, 0)
    step.check_sources()
    report = step.apply(make_session(model, random_tokens(8, 32, vocab=BYTE_VOCAB, seed=2),
                                     tokenizer=byte_tokenizer()))
    for record in report["alternatives"]:
        assert record["problems"] == ["HumanEval/162", "HumanEval/163"] and record["failures"] == [1.0, 1.0]
        assert "window_nlls" not in record
    assert report["chosen"] == 0 and report["pass_rate"] == 0.0 and report["tied"] == [1]
    assert "humaneval pass rate 0.0000 on its last 2 problems, tied with alternative 1: the first listed is " \
        "kept (score more than 2 problems to tell them apart)" in report["headline"]
    assert model.config.num_hidden_layers == 4


def test_best_of_chooses_the_fewest_failures(monkeypatch):
    """The alternative with the lowest failure rate wins; its margin is the paired mean difference per problem."""
    from recipe_engine.modifiers import best_of

    failures = iter([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    monkeypatch.setattr(best_of, "heldout_failures", lambda *a, **k: (["p0", "p1", "p2", "p3"], next(failures)))
    model = tiny_model(num_hidden_layers=6, seed=1)
    step = parse_step({"BestOf": {"alternatives": [["ShortGPT<n:2>"], ["SLEB<n:2>"]], "refit": False,
                                  "score": {"task": "gsm8k", "problems": 4}}}, 0)
    report = step.apply(make_session(model, random_tokens(8, 32, seed=2)))
    assert (report["lowest"], report["chosen"], report["pass_rate"], report["tied"]) == (1, 1, 0.75, [])
    assert report["runner_up"]["nats"] == pytest.approx(0.5)  # (1 + 0 + 1 + 0) / 4 more failures


def test_best_of_scoring_by_humaneval_needs_the_opt_in(monkeypatch):
    monkeypatch.delenv("RECIPE_ALLOW_CODE_EVAL", raising=False)
    step = parse_step({"BestOf": {"alternatives": [["ShortGPT<n:1>"], ["SLEB<n:1>"]],
                                  "score": {"task": "humaneval"}}}, 0)
    with pytest.raises(RecipeError, match="allow_code_execution: true") as caught:
        step.check_sources()
    assert "\n" not in str(caught.value)
    with pytest.raises(RecipeError, match="no generation task 'humaneva'"):
        parse_step({"BestOf": {"alternatives": [["ShortGPT<n:1>"], ["SLEB<n:1>"]],
                               "score": {"task": "humaneva"}}}, 0).check_sources()


def test_best_of_scores_by_agreement_with_the_original_models_completions(monkeypatch):
    """``score.by: agreement``: the original model writes the held-out problems' completions once; each
    alternative's score is its NLL of them (recomputed here on the kept model), nothing is executed (no opt-in),
    and the lowest wins."""
    from recipe_engine.evaluation.agreement import completion_scores, heldout_reference
    from recipe_engine.modifiers import best_of

    monkeypatch.delenv("RECIPE_ALLOW_CODE_EVAL", raising=False)
    model, tokenizer = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=6, seed=1), byte_tokenizer()
    reference = heldout_reference(copy.deepcopy(model), tokenizer, "humaneval", 2, 6, 8, "cpu")
    generated = []
    monkeypatch.setattr(best_of, "heldout_reference", lambda *a, **k: generated.append(1) or reference)
    step = parse_step({"BestOf": {"alternatives": [["ShortGPT<n:2>"], ["SLEB<n:2>"]], "refit": False, "score": {
        "task": "humaneval", "by": "agreement", "problems": 2, "max_new_tokens": 6}}}, 0)
    step.check_sources()  # no opt-in needed: nothing runs
    session = make_session(model, random_tokens(8, 32, vocab=BYTE_VOCAB, seed=2), tokenizer=tokenizer)
    report = step.apply(session)
    assert generated == [1]
    scores = [record["agreement_nll"] for record in report["alternatives"]]
    assert report["lowest"] == report["chosen"] == scores.index(min(scores))
    for record in report["alternatives"]:
        assert record["problems"] == ["HumanEval/162", "HumanEval/163"] and len(record["problem_nlls"]) == 2
    kept = completion_scores(session.model, tokenizer, reference, "cpu")
    assert kept["nll"] == pytest.approx(min(scores), rel=1e-6)
    assert f"NLL {min(scores):.4f} of the original model's completions of the last 2 humaneval" in report["headline"]


def decoder_parameters(model) -> int:
    """Parameters of the decoder layers, counted on the model itself (the budget's independent reference)."""
    return sum(p.numel() for p in model.model.layers.parameters())


def test_a_budget_refuses_what_is_over_it_and_lets_sizes_differ(tmp_path):
    """``budget.parameters: 70%`` on six layers: one layer cut (83 %) is refused with its figures, two layers
    cut and a width cut (different shapes) both run; each alternative's recorded size equals the parameters
    of the model it leaves, counted on the model."""
    model = tiny_model(num_hidden_layers=6, vocab_size=BYTE_VOCAB)
    before = decoder_parameters(model)
    alternatives = [["ShortGPT<n:1>"], ["ShortGPT<n:2>"], ["WidthPrune<intermediate_size:48,kv_groups_keep:1>"]]
    steps = [{"BestOf": {"budget": {"parameters": "70%"}, "alternatives": alternatives, "refit": False}}]
    kept, report = recipe_engine.apply(recipe(tmp_path, steps), model=model, tokenizer=byte_tokenizer(),
                                       write=False, progress=False)
    result = report.steps[0].result
    refused = result["alternatives"][0]["refused"]
    assert refused.startswith("over the budget: ") and "(83.33 %)" in refused and "(70%)" in refused
    assert result["budget"] == {"parameters": "70%"}
    for record in result["alternatives"][1:]:
        assert record["bits_per_weight"] == 32.0 and record["share_of_parameters"] <= 0.7
    chosen = result["alternatives"][result["chosen"]]
    assert chosen["decoder_parameters"] == decoder_parameters(kept)
    assert chosen["share_of_parameters"] == pytest.approx(decoder_parameters(kept) / before)
    sizes = {r["decoder_parameters"] for r in result["alternatives"][1:]}
    assert len(sizes) == 2  # different shapes, allowed under a budget


def written_layer_bytes(directory) -> int:
    """Bytes of the decoder layers' tensors in a written checkpoint, read from the safetensors headers (the
    budget's independent reference); compressed-tensors' ``weight_shape`` records (a linear's shape, not its
    weight) are left out, as bits per weight leaves them out."""
    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        total += sum(entry["data_offsets"][1] - entry["data_offsets"][0] for name, entry in header.items()
                     if name.startswith("model.layers.") and not name.endswith("weight_shape"))
    return total


@pytest.mark.parametrize("kept", ["ShortGPT<n:4>", "GPTQ<bits:4,group_size:16>"])
def test_a_weight_bytes_budget_is_the_written_layers_bytes(tmp_path, kept):
    """``budget.weight_bytes: 50%`` on six fp32 layers: one layer cut (83 %) is refused with its figures; a
    depth cut (fp32) and a 4-bit quantization (codes, scales and zero points) fit, and the recorded bytes of
    the kept one are those of the decoder-layer tensors in the checkpoint written, its share of those of the
    model received counted on that model."""
    model = tiny_model(num_hidden_layers=6, vocab_size=BYTE_VOCAB)
    before = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    steps = [{"BestOf": {"budget": {"weight_bytes": "50%"}, "alternatives": [["ShortGPT<n:1>"], [kept]],
                         "refit": False}}]
    recipe_engine.apply(recipe(tmp_path, steps), model=model, tokenizer=byte_tokenizer(), progress=False)
    result = recipe_engine.load_report(tmp_path / "out").steps[0].result
    refused = result["alternatives"][0]["refused"]
    assert refused.startswith("over the budget: ")
    assert "bytes of decoder-layer weights (83.33 % of those received)" in refused
    assert f"> {before // 2:,} (50%)" in refused
    chosen = result["alternatives"][1]
    assert result["chosen"] == 1 and chosen["decoder_weight_bytes"] == written_layer_bytes(tmp_path / "out")
    assert chosen["share_of_weight_bytes"] == pytest.approx(chosen["decoder_weight_bytes"] / before)
    assert chosen["share_of_weight_bytes"] <= 0.5
    assert f"{chosen['decoder_weight_bytes'] / 1e6:,.1f} MB" in result["table"]["rows"][1]
    # validation says each alternative's figures before any weight loads: the refused one's, and the kept one's
    notes = check_against_config(recipe_from_dict(recipe(tmp_path, steps)),
                                 tiny_config(num_hidden_layers=6, vocab_size=BYTE_VOCAB)).notes
    assert notes[0] == f"BestOf skips alternative 0 [ShortGPT]: {refused}"  # n: 1 is the default
    assert notes[1].startswith("BestOf alternative 1 [") and " fits its budget: " in notes[1]
    assert f"{chosen['decoder_weight_bytes']:,} bytes of decoder-layer weights" in notes[1]


@pytest.mark.parametrize("wrong", ["120%", "0MB", "4 XB", 0, "x"])
def test_a_weight_bytes_budget_refuses_what_is_not_a_size_in_one_line(wrong):
    with pytest.raises(RecipeError, match="byte count") as caught:
        parse_step({"BestOf": {"budget": {"weight_bytes": wrong}, "alternatives": [["ShortGPT<n:1>"],
                                                                                  ["SLEB<n:1>"]]}}, 0)
    assert "\n" not in str(caught.value)


def test_a_step_after_a_budgeted_choice_of_different_shapes_is_refused(tmp_path):
    steps = [{"BestOf": {"budget": {"parameters": "70%"}, "alternatives": [
        ["ShortGPT<n:2>"], ["WidthPrune<intermediate_size:48,kv_groups_keep:1>"]]}}, "GPTQ<bits:4,group_size:16>"]
    config = tiny_config(num_hidden_layers=6, vocab_size=BYTE_VOCAB)
    with pytest.raises(RecipeError, match="comes after BestOf .under its budget., whose alternatives leave models "
                                          "of different sizes") as caught:
        check_against_config(recipe_from_dict(recipe(tmp_path, steps)), config)
    assert "\n" not in str(caught.value) and "step 1" in str(caught.value)
    for wrong, why in [("120%", "parameter count or a percentage"), ("0", "parameter count or a percentage"),
                       ("x%", "parameter count or a percentage"), (True, "got the boolean true")]:
        with pytest.raises(RecipeError, match=why):
            parse_step({"BestOf": {"budget": {"parameters": wrong}, "alternatives": [["ShortGPT<n:1>"],
                                                                                       ["SLEB<n:1>"]]}}, 0)


def test_the_card_lists_every_candidate_with_its_size_score_and_fate(tmp_path):
    """report.json's candidates table and the model card's: one row per alternative, the refused one with its
    reason, the scored ones with their recorded share and score, the chosen one marked."""
    model = tiny_model(num_hidden_layers=6, vocab_size=BYTE_VOCAB)
    alternatives = [["ShortGPT<n:1>"], ["ShortGPT<n:2>"], ["WidthPrune<intermediate_size:48,kv_groups_keep:1>"]]
    steps = [{"BestOf": {"budget": {"parameters": "70%"}, "alternatives": alternatives, "refit": False}}]
    recipe_engine.apply(recipe(tmp_path, steps), model=model, tokenizer=byte_tokenizer(), progress=False)
    result = recipe_engine.load_report(tmp_path / "out").steps[0].result
    card = (tmp_path / "out" / "README.md").read_text()
    records = result["alternatives"]
    assert [row[0] for row in result["table"]["rows"]] == [0, 1, 2]
    for record, row in zip(records, result["table"]["rows"]):
        line = next(line for line in card.splitlines() if line.startswith(f"  | {record['alternative']} | "))
        if "refused" in record:
            assert record["refused"].split(":")[0] in line and row[5] == "" and row[4] == ""
        else:
            assert f"{100 * record['share_of_parameters']:.2f} %" in line and f"{record['nll']:.4f}" in line
            assert ("chosen" in line) == (record["alternative"] == result["chosen"])


def test_a_task_score_fits_every_alternative_on_all_windows_as_it_would_run_alone(monkeypatch, tmp_path):
    """With ``score.task`` no calibration window is held out: the kept model is bit for bit the chosen
    alternative run alone by a plain recipe on the same calibration (the independent reference), and the
    refit, which would repeat that run, is skipped with its reason."""
    from recipe_engine.evaluation.agreement import heldout_reference
    from recipe_engine.modifiers import best_of

    monkeypatch.delenv("RECIPE_ALLOW_CODE_EVAL", raising=False)
    model, tokenizer = tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=6, seed=1), byte_tokenizer()
    reference = heldout_reference(copy.deepcopy(model), tokenizer, "humaneval", 2, 6, 8, "cpu")
    monkeypatch.setattr(best_of, "heldout_reference", lambda *a, **k: reference)
    alternatives = [["WidthPrune<intermediate_size:48>"], ["ShortGPT<n:2>", "LinearPatch"]]
    steps = [{"BestOf": {"alternatives": alternatives, "budget": {"parameters": "90%"},
                         "score": {"task": "humaneval", "by": "agreement", "problems": 2, "max_new_tokens": 6}}}]
    kept, report = recipe_engine.apply(recipe(tmp_path, steps), model=copy.deepcopy(model), tokenizer=tokenizer,
                                       write=False, progress=False)
    result = report.steps[0].result
    samples = recipe(tmp_path, steps)["calibration"]["samples"]
    assert result["score"]["fit_windows"] == list(range(samples)) and result["score"]["score_windows"] == []
    assert "would repeat the chosen one's run" in result["refit"]["skipped"]
    alone, _ = recipe_engine.apply(recipe(tmp_path, alternatives[result["chosen"]]), model=copy.deepcopy(model),
                                   tokenizer=tokenizer, write=False, progress=False)
    assert kept.state_dict().keys() == alone.state_dict().keys()
    for name, tensor in alone.state_dict().items():
        assert torch.equal(kept.state_dict()[name], tensor), name
