"""The opt-in to run model-written code (``humaneval``) is named as each command takes it, and every way a
message names works for that command: ``recipe eval``'s ``--allow-code-execution``; for ``apply``,
``validate`` and ``sweep`` the recipe's ``evaluate.allow_code_execution: true`` (in the file or by ``--set``);
``$RECIPE_ALLOW_CODE_EVAL=1`` for all. Only the pre-flight runs: loading a model after it is stopped with a
marker line, so nothing is generated."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from recipe_engine.cli import main
from recipe_engine.errors import RecipeError
from tests.helpers import refuse_loading, refused_in_one_line

PASSED = "passed the pre-flight; loading stopped by the test"
#: What a recipe command's message must offer, and what only ``recipe eval`` takes.
RECIPE_WAYS = ("set evaluate.allow_code_execution: true in the recipe", "--set evaluate.allow_code_execution=true",
               "RECIPE_ALLOW_CODE_EVAL=1")
EVAL_WAYS = ("pass --allow-code-execution", "RECIPE_ALLOW_CODE_EVAL=1")


@pytest.fixture(autouse=True)
def stopped_at_loading(monkeypatch):
    """No opt-in from the environment; loading a model ends the command with one line (exit 2)."""
    monkeypatch.delenv("RECIPE_ALLOW_CODE_EVAL", raising=False)

    def stop(*_a, **_k):
        raise RecipeError(PASSED)
    refuse_loading(monkeypatch, stop)


def write_recipe(tmp_path, model_dir, allowed: bool = False) -> str:
    (tmp_path / "cal.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    evaluate = {"tasks": ["humaneval"], "perplexity": None, **({"allow_code_execution": True} if allowed else {})}
    recipe = {"version": 1, "name": "t", "model": str(model_dir), "output": str(tmp_path / "out"),
              "calibration": {"dataset": str(tmp_path / "cal.txt"), "samples": 4, "seq_len": 32, "batch_size": 2},
              "modifiers": ["FuseNorm"], "evaluate": evaluate}
    path = tmp_path / ("allowed.yaml" if allowed else "r.yaml")
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def command(name: str, recipe: str, tmp_path, *extra: str) -> list[str]:
    tail = ["--output", str(tmp_path / "sweep")] if name == "sweep" else []
    return [name, recipe, *extra, *tail]


@pytest.mark.parametrize("name", ["validate", "apply", "sweep"])
def test_a_recipe_command_names_the_recipes_opt_in_not_evals_flag(name, tmp_path, model_dir, capsys):
    line = refused_in_one_line(capsys, main, command(name, write_recipe(tmp_path, model_dir), tmp_path),
                               "field 'evaluate.tasks': task humaneval executes model-written code", *RECIPE_WAYS)
    assert "--allow-code-execution" not in line and PASSED not in line
    # the flag the message used to name is not one of these commands'
    refused_in_one_line(capsys, main, command(name, write_recipe(tmp_path, model_dir), tmp_path,
                                              "--allow-code-execution"), "unrecognized arguments")


@pytest.mark.parametrize("way", ["field", "--set", "environment"])
@pytest.mark.parametrize("name", ["validate", "apply", "sweep"])
def test_each_way_a_recipe_commands_message_names_opts_in(name, way, tmp_path, model_dir, capsys, monkeypatch):
    recipe, extra = write_recipe(tmp_path, model_dir, allowed=way == "field"), []
    if way == "--set":
        extra = ["--set", "evaluate.allow_code_execution=true"]
    if way == "environment":
        monkeypatch.setenv("RECIPE_ALLOW_CODE_EVAL", "1")
    capsys.readouterr()
    code = main(command(name, recipe, tmp_path, *extra))
    printed = capsys.readouterr()
    if name == "validate":
        assert code == 0 and printed.out.strip() == f"{recipe}: ok (llama, 4 → 4 layers)", printed.err
    else:  # past the pre-flight: the first model load is where the test stops it
        assert code == 2 and PASSED in printed.err and "executes model-written code" not in printed.err, printed.err


def test_eval_names_its_flag_and_each_way_it_names_opts_in(model_dir, capsys, monkeypatch):
    argv = ["eval", str(model_dir), "--no-ppl", "--tasks", "humaneval", "--device", "cpu"]
    line = refused_in_one_line(capsys, main, argv, "task humaneval executes model-written code", *EVAL_WAYS)
    assert "evaluate.allow_code_execution" not in line
    refused_in_one_line(capsys, main, [*argv, "--allow-code-execution"], PASSED)
    monkeypatch.setenv("RECIPE_ALLOW_CODE_EVAL", "1")
    refused_in_one_line(capsys, main, argv, PASSED)


@pytest.mark.parametrize("way", [None, "--set", "environment"])
def test_a_step_scored_by_humaneval_names_its_own_opt_in_and_it_works(way, tmp_path, model_dir, capsys, monkeypatch):
    """BestOf's ``score.task: humaneval``: the opt-in is the step's ``score.allow_code_execution`` (in the file
    or by ``--set modifiers.0.score.allow_code_execution=true``) or the environment variable."""
    recipe = yaml.safe_load(Path(write_recipe(tmp_path, model_dir)).read_text())
    recipe.update(evaluate=None, modifiers=[{"BestOf": {"alternatives": [["ShortGPT<n:1>"], ["SLEB<n:1>"]],
                                                        "score": {"task": "humaneval", "problems": 2}}}])
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    argv = ["validate", str(tmp_path / "r.yaml")]
    if way is None:
        line = refused_in_one_line(capsys, main, argv, "step 0 (BestOf): field 'score.task': task humaneval executes "
                                   "model-written code: set score.allow_code_execution: true in this step (or --set "
                                   "modifiers.<step>.score.allow_code_execution=true), or RECIPE_ALLOW_CODE_EVAL=1")
        assert "--allow-code-execution" not in line
        return
    if way == "--set":
        argv += ["--set", "modifiers.0.score.allow_code_execution=true"]
    else:
        monkeypatch.setenv("RECIPE_ALLOW_CODE_EVAL", "1")
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'r.yaml'}: ok (llama, 4 → 3 layers)")


def test_no_sandbox_for_this_user_is_one_line_before_loading(monkeypatch):
    """Where the kernel refuses user namespaces (a non-root user) and the weaker mode was not asked for by
    name, the pre-flight stops with the sandbox's one line, before any model loads."""
    from recipe_engine.errors import RecipeError
    from recipe_engine.evaluation import generation, sandbox

    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sandbox, "_probe", lambda mode: "unshare: Operation not permitted")
    monkeypatch.delenv(sandbox.MODE_ENV, raising=False)
    sandbox.isolation.cache_clear()
    try:
        with pytest.raises(RecipeError, match="needs user namespaces, which this system refuses .*RECIPE_SANDBOX="
                                              "audit-hook"):
            generation.check_scoring_task("humaneval", True)
        monkeypatch.setenv(sandbox.MODE_ENV, "audit-hook")
        sandbox.isolation.cache_clear()
        generation.check_scoring_task("humaneval", True)
        assert sandbox.isolation() == "audit-hook"
    finally:
        sandbox.isolation.cache_clear()
