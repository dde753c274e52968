"""``--set`` overrides: every example in README.md and docs/ lands where it says, on the recipe it names, and a
path down a modifier's group of fields (BestOf's ``score``) works while a misspelling at any depth is one line."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from recipe_engine.cli import main
from recipe_engine.errors import RecipeError
from recipe_engine.recipe.files import load_recipe
from recipe_engine.recipe.schema import dump_recipe, recipe_from_dict, safe_load
from tests.helpers import refused_in_one_line

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # an inline code span, possibly wrapped over two lines
PLACEHOLDER = re.compile(r"[A-Z]|^a\.b=")      # PATH=VALUE, modifiers.N.x, a.b=v: a syntax, not an example
#: Examples whose command names no recipe, and the recipe their sentence is about.
CONTEXT = {
    "modifiers.0.score.prefer_earlier_within=1": "recipes/depth20_auto.yaml",  # "the auto recipe"
    "modifiers.0.fold=hook": "recipes/replaceme_smollm2.yaml",                 # "on Gemma 3 add"
    "modifiers.2.lambda_scale=5": "recipes/flatten20_smollm2.yaml",            # its step 2 is HeadPrune
    "modifiers.1.n=4": "recipes/flatten20_smollm2.yaml",                       # getting started's recipe
    "calibration.samples=64": "recipes/flatten20_smollm2.yaml",
    "evaluate.allow_code_execution=true": "recipes/flatten20_smollm2.yaml",  # errors.md: the opt-in of apply
}


def commands(text: str) -> list[tuple[int, str]]:
    """(line, command) of every fenced code line (``\\`` continuations joined) and every inline code span."""
    found = []
    for block in FENCE.finditer(text):
        first = text[:block.start()].count("\n") + 2
        found += [(first, line) for line in block.group(1).replace("\\\n", " ").splitlines()]
    prose = FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), text)
    found += [(prose[:span.start()].count("\n") + 1, span.group(1).replace("\n", " ")) for span in SPAN.finditer(prose)]
    return found


def examples() -> list[tuple[str, str, list[str], str | None]]:
    """(where, recipe, overrides, model) of each command in README.md and docs/ that passes ``--set``."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for line, command in commands(page.read_text(encoding="utf-8")):
            if "--set" not in command or command.startswith("error:"):  # a quoted error message is no example
                continue
            words = shlex.split(command, comments=True)
            sets = [value for flag, value in zip(words, words[1:]) if flag == "--set" and not PLACEHOLDER.search(value)]
            if not sets:
                continue
            model = next((value for flag, value in zip(words, words[1:]) if flag == "--model"), None)
            recipe = next((w for w in words if re.fullmatch(r"recipes/[\w.-]+\.yaml", w)), None)
            where = f"{page.relative_to(ROOT)}:{line}"
            recipe = recipe or CONTEXT.get(sets[0])
            assert recipe, f"{where}: `{command}` names no recipe; add its recipe to CONTEXT in this test"
            found.append((where, recipe, sets, model if model and model.lower() != "m" else None))
    return found


EXAMPLES = examples()


def test_the_docs_examples_were_found():
    """The extraction sees the examples that a user meets first (so an empty list is not a pass)."""
    everything = {assignment for _, _, sets, _ in EXAMPLES for assignment in sets}
    assert {"modifiers.0.score.prefer_earlier_within=1", "modifiers.0.score.task=humaneval", "modifiers.0.n=20%",
            "modifiers.0.export=gptq", "calibration.samples=64", "export={format: gguf}"} <= everything
    assert {where.split(":")[0] for where, *_ in EXAMPLES} >= {"README.md", "docs/methods/bestof.md"}


def landed(resolved: dict, path: str):
    """The value at a ``--set`` path of a resolved recipe (``modifiers.I.…`` goes through the step's name)."""
    keys = path.split(".")
    if keys[0] == "modifiers":
        step = resolved["modifiers"][int(keys[1])]
        node, keys = next(iter(step.values())), keys[2:]
    else:
        node = resolved
    for key in keys:
        node = node[key]
    return node


@pytest.mark.parametrize("where, recipe, sets, model", EXAMPLES, ids=[f"{e[0]} {' '.join(e[2])}" for e in EXAMPLES])
def test_every_documented_override_lands_in_the_resolved_recipe(where, recipe, sets, model, capsys):
    argv = (["show", str(ROOT / recipe), *(a for s in sets for a in ("--set", s))]
            + (["--model", model] if model else []))
    capsys.readouterr()
    code = main(argv)
    printed = capsys.readouterr()
    assert code == 0, f"{where}: recipe {' '.join(argv)}: {printed.err}"
    resolved = yaml.safe_load(printed.out)
    for assignment in sets:
        path, _, raw = assignment.partition("=")
        want, got = safe_load(raw), landed(resolved, path)
        if isinstance(want, dict):  # a group given in part: the fields named, the rest their defaults
            got = {key: got[key] for key in want}
        assert got == want, f"{where}: {assignment} gave {path} = {got!r}"
    assert set(sets) <= set(resolved["overrides"])  # recorded in the saved recipe
    if model:
        assert resolved["model"] == model


def write(tmp_path, score: dict | None = None) -> str:
    step = {"BestOf": {"alternatives": [["ShortGPT<n:1>"], ["SLEB<n:1>"]], **({"score": score} if score else {})}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "name": "t", "model": "m", "modifiers": ["FuseNorm", step],
                                    "output": str(tmp_path / "out")}, sort_keys=False))
    return str(path)


def test_a_field_of_a_group_is_set_and_the_groups_other_fields_stay(tmp_path):
    path = write(tmp_path, {"fraction": 0.3})
    loaded = load_recipe(path, ["modifiers.1.score.prefer_earlier_within=1", "modifiers.1.score.task=humaneval"])
    score = loaded.recipe.modifiers[1].score
    assert (score.prefer_earlier_within, score.task, score.fraction, score.problems) == (1, "humaneval", 0.3, 20)
    # started from the defaults when the recipe gives no score, and the saved recipe loads back equal to itself
    recipe = load_recipe(write(tmp_path), ["modifiers.1.score.seed=7"]).recipe
    assert recipe.modifiers[1].score.seed == 7 and recipe.modifiers[1].score.fraction == 0.25
    assert recipe_from_dict(yaml.safe_load(dump_recipe(recipe))) == recipe
    # outside the steps: a field of a group that is null in the recipe (export)
    assert load_recipe(path, ["export.format=gguf"]).recipe.export.format == "gguf"


@pytest.mark.parametrize("assignment, fragments", [
    ("modifiers.1.score.prefer_earlier_withn=1",
     ("step 1 (BestOf): field 'score.prefer_earlier_withn': unknown field; did you mean 'prefer_earlier_within'?",)),
    ("modifiers.1.scor.task=humaneval", ("step 1 (BestOf): field 'scor': unknown field; did you mean 'score'?",)),
    ("modifiers.1.refit.x=1", ("step 1 (BestOf): override 'modifiers.1.refit.x=1': parameter 'refit' is not a group "
                               "of fields: set it whole (modifiers.1.refit=VALUE)",)),
    ("export.formt=gguf", ("override 'export.formt=gguf': unknown path 'export.formt'; did you mean "
                           "'export.format'?",)),
])
def test_a_misspelled_path_at_any_depth_is_one_line(tmp_path, capsys, assignment, fragments):
    path = write(tmp_path)
    with pytest.raises(RecipeError):
        load_recipe(path, [assignment])
    refused_in_one_line(capsys, main, ["show", path, "--set", assignment], path, *fragments)
