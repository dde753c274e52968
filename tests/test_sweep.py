"""``recipe sweep``: variants, shared work computed once (counted), resumable rows, Pareto front."""
from __future__ import annotations

import json
import random

import pytest
import yaml

import recipe_engine
import recipe_engine.workflows.sweep as sweep_module
from recipe_engine.cli import main
from recipe_engine.errors import RecipeError
from recipe_engine.workflows.sweep import Sweep, pareto_front, variants
from tests.helpers import BYTE_VOCAB, byte_tokenizer, tiny_model


@pytest.fixture()
def recipes(tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_model(vocab_size=BYTE_VOCAB, num_hidden_layers=6).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"The {w} quick brown fox jumps over the lazy dog number {w}." for w in range(200)))
    common = dict(version=1, model=str(model_dir), device="cpu", output=str(tmp_path / "unused"),
                  calibration=dict(dataset=str(text), samples=4, seq_len=32, batch_size=2),
                  evaluate=dict(perplexity=dict(dataset=[str(text)], split="train", seq_len=64, limit=3)))
    flatten = dict(common, name="flatten", modifiers=["FuseNorm", {"FlattenAdjacent": {"n": 1}}, "HeadPrune",
                                                      "NystromMLP"])
    short = dict(common, name="short", modifiers=[{"ShortGPT": {"n": 1}}])
    sleb = dict(common, name="sleb", modifiers=[{"SLEB": {"n": 1}}])
    paths = []
    for recipe in (flatten, short, sleb):
        path = tmp_path / f"{recipe['name']}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        paths.append(str(path))
    return paths


def test_shared_work_is_computed_once_and_rows_equal_plain_runs(recipes, tmp_path):
    sweep = Sweep(recipes[:1], ["modifiers.1.n=1,2,3"], str(tmp_path / "sweep"), eval_limit=2)
    rows = sweep.run()
    assert [r["recipe"] for r in rows] == ["dense", "flatten", "flatten", "flatten"]
    assert [r["layers"] for r in rows] == [6, 5, 4, 3]
    shared = sweep.shared_work()
    assert shared["FlattenAdjacent similarity"] == {"computed": 1, "reused": 2}
    assert shared["calibration capture"]["reused"] >= 2
    # the reused similarity gives exactly the plain run's model (independent: no memo, fresh load)
    plain, _ = recipe_engine.apply(variants(recipes[0], [("modifiers.1.n", [2])])[0][1], write=False,
                                   progress=False)
    from recipe_engine.evaluation import perplexity
    from recipe_engine.sources.text import load_text

    tokenizer = byte_tokenizer()
    text = load_text(str(tmp_path / "text.txt"), "train").text
    assert perplexity(plain, tokenizer, text, seq_len=64, limit=2)["ppl"] == pytest.approx(rows[2]["ppl"], rel=1e-6)
    saved = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [r["recipe_sha256"] for r in saved["rows"]] == [r["recipe_sha256"] for r in rows]


def test_interrupted_sweep_keeps_rows_and_rerun_skips_them(recipes, tmp_path, monkeypatch, capsys):
    calls = []
    real_apply = sweep_module.apply

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(sweep_module, "apply", interrupting)
    out = str(tmp_path / "sweep")
    argv = ["sweep", recipes[0], "--recipes", recipes[1], "--vary", "n=1,2", "--output", out, "--quiet",
            "--eval-limit", "1"]
    assert main(argv) == 130
    assert "3 finished rows kept" in capsys.readouterr().err  # dense + 2 variants
    kept = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["rows"]
    assert [r["recipe"] for r in kept] == ["dense", "flatten", "flatten"]
    calls.clear()
    monkeypatch.setattr(sweep_module, "apply", real_apply)
    counted = []
    monkeypatch.setattr(sweep_module, "apply", lambda *a, **k: counted.append(1) or real_apply(*a, **k))
    assert main(argv) == 0
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["rows"]
    assert len(counted) == 2  # only ShortGPT n=1, n=2 ran
    assert [(r["recipe"], r["layers"]) for r in rows] == [("dense", 6), ("flatten", 5), ("flatten", 4),
                                                          ("short", 5), ("short", 4)]
    assert (tmp_path / "sweep" / "pareto.png").stat().st_size > 1000
    counted.clear()
    assert main(argv) == 0 and not counted  # everything done: nothing runs again
    assert main([*argv[:-2], "--eval-limit", "2"]) == 0 and len(counted) == 4  # other evaluation: all again


def test_a_sweep_out_of_memory_keeps_its_rows_in_one_line(recipes, tmp_path, monkeypatch, capsys):
    """A variant that runs out of GPU memory ends the sweep with one line (exit 4); the rows finished before it
    stay in sweep.json, as after a signal."""
    import torch

    real_apply, calls = sweep_module.apply, []

    def out_of_memory(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(sweep_module, "apply", out_of_memory)
    out = tmp_path / "sweep"
    argv = ["sweep", recipes[1], "--vary", "n=1,2", "--output", str(out), "--quiet", "--eval-limit", "1"]
    assert main(argv) == 4
    err = capsys.readouterr().err.strip()
    assert err == (f"error: out of GPU memory: CUDA out of memory. Tried to allocate 2.00 GiB; 2 finished rows kept "
                   f"in {out}/sweep.json (rerun to continue)"), err
    assert [r["recipe"] for r in json.loads((out / "sweep.json").read_text())["rows"]] == ["dense", "short"]


def test_sleb_rounds_are_shared_across_n(recipes, tmp_path):
    """n=3 first, then n=1 and n=2 reuse its rounds (greedy prefix); each equals a plain run."""
    sweep = Sweep(recipes[2:], ["n=3,1,2"], str(tmp_path / "sweep"), eval_limit=2)
    rows = sweep.run()
    assert sweep.shared_work()["SLEB rounds"] == {"computed": 1, "reused": 2}
    for row in rows[1:]:
        plain, report = recipe_engine.apply(variants(recipes[2], [("n", [row["params"]["modifiers.0.n"]])])[0][1],
                                            write=False, progress=False)
        assert plain.config.num_hidden_layers == row["layers"]
        from recipe_engine.sources.text import load_text
        from recipe_engine.evaluation import perplexity

        text = load_text(str(tmp_path / "text.txt"), "train").text
        assert perplexity(plain, byte_tokenizer(), text, seq_len=64, limit=2)["ppl"] == pytest.approx(row["ppl"],
                                                                                                      rel=1e-6)


def test_bare_field_must_name_one_step(recipes, tmp_path):
    with pytest.raises(RecipeError, match="0 steps set 'lambda_scale'"):
        variants(recipes[1], [("lambda_scale", [1])])
    assert [r.modifiers[0].n for _, r in variants(recipes[1], [("n", [2, 3])])] == [2, 3]


def test_invalid_yaml_in_vary_is_one_line(recipes, tmp_path, capsys):
    out = tmp_path / "sweep-out"
    assert main(["sweep", recipes[1], "--vary", "n=[", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--vary 'n=['" in err[0] and "YAML" in err[0]
    assert not out.exists()


def test_pareto_front_matches_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        points = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(rng.randint(1, 12))]
        front = set(pareto_front(points))
        for i, (x, y) in enumerate(points):
            beaten = any((a <= x and b <= y and (a, b) != (x, y)) or ((a, b) == (x, y) and j < i)
                         for j, (a, b) in enumerate(points) if j != i)
            assert (i in front) == (not beaten), (points, i)
