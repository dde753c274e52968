"""CLI commands: show, diff (with path@gitrev), validate --model, plan, list-modifiers."""

import pytest
import yaml

from recipe_engine.cli import main
from tests.helpers import git_repository, tiny_config

BASE = {"version": 1, "name": "t", "model": "smollm2-135m", "output": "out/t", "modifiers": ["FuseNorm"]}


def write(path, data):
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def test_show_prints_canonical_form_with_overrides(tmp_path, capsys):
    path = write(tmp_path / "r.yaml", BASE)
    assert main(["show", path, "--set", "calibration.samples=32"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["calibration"]["samples"] == 32
    assert shown["overrides"] == ["calibration.samples=32"]
    assert shown["modifiers"] == [{"FuseNorm": {"final_norm": True, "untie": False}}]


def test_diff_reports_semantic_changes(tmp_path, capsys):
    old = write(tmp_path / "a.yaml", BASE)
    new = write(tmp_path / "b.yaml", {**BASE, "dtype": "bfloat16",
                                      "modifiers": ["FuseNorm<untie:true>", "FuseNorm"]})
    assert main(["diff", old, new]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "~ dtype: 'float32' -> 'bfloat16'" in lines
    assert "~ step 0 FuseNorm.untie: False -> True" in lines
    assert any(line.startswith("+ step 1 FuseNorm added") for line in lines)


def test_diff_against_git_revision(tmp_path, capsys):
    repo = tmp_path / "repo"
    git = git_repository(repo)
    path = write(repo / "r.yaml", BASE)
    git("add", "r.yaml")
    git("commit", "-qm", "one")
    write(repo / "r.yaml", {**BASE, "calibration": {"samples": 16}})
    assert main(["diff", f"{path}@HEAD", path]) == 0
    assert capsys.readouterr().out.strip() == "~ calibration.samples: 128 -> 16"
    assert main(["diff", f"{path}@HEAD~5", path]) == 2
    assert "cannot read revision 'HEAD~5'" in capsys.readouterr().err


@pytest.mark.parametrize("rev", ["--output=pwned", "-p", "--help", "-", "", "HEAD --output=pwned",
                                 "--end-of-options"])
def test_diff_revision_is_never_an_option(tmp_path, capsys, monkeypatch, rev):
    """A revision is verified as a commit before git reads it; one that looks like an option is refused in
    one line and git writes nothing (``git show --output=FILE`` would write FILE)."""
    repo = tmp_path / "repo"
    git = git_repository(repo)
    write(repo / "-r.yaml", BASE)
    git("add", "--", "-r.yaml")
    git("commit", "-qm", "one")
    monkeypatch.chdir(repo)
    before = sorted(p.name for p in repo.iterdir())
    assert main(["diff", "--", f"-r.yaml@{rev}", "-r.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot read revision '{rev}'" in err[0], err
    assert sorted(p.name for p in repo.iterdir()) == before
    assert main(["diff", "--", "-r.yaml@HEAD", "-r.yaml"]) == 0  # a path starting with '-' is read as a path


def test_validate_against_local_model_config(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    tiny_config("qwen2", max_position_embeddings=2048).save_pretrained(model_dir)
    path = write(tmp_path / "r.yaml", {**BASE, "model": "smollm2-135m"})
    assert main(["validate", path, "--model", str(model_dir)]) == 0
    assert "ok (qwen2, 4 → 4 layers)" in capsys.readouterr().out


def test_plan_lists_steps_and_passes(tmp_path, capsys):
    path = write(tmp_path / "r.yaml", BASE)
    assert main(["plan", path]) == 0
    out = capsys.readouterr().out
    assert "FuseNorm" in out and "total calibration passes: 0" in out


def test_list_modifiers_shows_parameters(capsys):
    assert main(["list-modifiers"]) == 0
    out = capsys.readouterr().out
    assert "FuseNorm [model]" in out and "untie" in out
