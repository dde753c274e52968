"""Recipe parsing: compact and mapping steps, canonical dump round-trip, overrides."""
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe_engine.errors import RecipeError
from recipe_engine.recipe.files import apply_override, load_recipe
from recipe_engine.recipe.schema import dump_recipe, parse_compact, recipe_from_dict

BASE = {"version": 1, "name": "t", "model": "smollm2-135m", "output": "out/t",
        "modifiers": ["FuseNorm"]}


def recipe(**changes):
    return recipe_from_dict({**BASE, **changes})


def test_compact_and_mapping_steps_build_the_same_model():
    a = recipe(modifiers=["FuseNorm<untie:true,final_norm:false>"])
    b = recipe(modifiers=[{"FuseNorm": {"untie": True, "final_norm": False}}])
    assert a.modifiers == b.modifiers
    assert dump_recipe(a) == dump_recipe(b)


def test_same_modifier_may_appear_twice():
    r = recipe(modifiers=["FuseNorm", {"FuseNorm": {"untie": True}}])
    assert [type(m).__name__ for m in r.modifiers] == ["FuseNorm", "FuseNorm"]
    assert r.modifiers[0].untie is False and r.modifiers[1].untie is True


def test_compact_parser_handles_lists_and_strings():
    assert parse_compact("X<layers:[1,2,3],mode:fast,scale:1.5>") == (
        "X", {"layers": [1, 2, 3], "mode": "fast", "scale": 1.5})
    assert parse_compact("X") == ("X", {})


def test_canonical_dump_resolves_every_default():
    dumped = yaml.safe_load(dump_recipe(recipe()))
    assert dumped["modifiers"] == [{"FuseNorm": {"final_norm": True, "untie": False}}]
    assert dumped["calibration"]["samples"] == 128


names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-0123456789", min_size=1, max_size=12)
steps = st.lists(st.one_of(
    st.just("FuseNorm"),
    st.builds(lambda u, f: f"FuseNorm<untie:{str(u).lower()},final_norm:{str(f).lower()}>",
              st.booleans(), st.booleans()),
    st.builds(lambda u: {"FuseNorm": {"untie": u}}, st.booleans())), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(name=names, steps=steps, samples=st.integers(1, 4096), seq_len=st.integers(2, 8192),
       seed=st.integers(-2**31, 2**31), dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       description=st.text(max_size=40), propagate=st.sampled_from(["compressed", "original"]),
       overrides=st.lists(st.text(max_size=20), max_size=3))
def test_dump_load_dump_is_lossless(name, steps, samples, seq_len, seed, dtype, description,
                                    propagate, overrides):
    r = recipe(name=name, modifiers=steps, dtype=dtype, description=description, overrides=overrides,
               calibration={"samples": samples, "seq_len": seq_len, "seed": seed, "propagate": propagate})
    text = dump_recipe(r)
    again = recipe_from_dict(yaml.safe_load(text))
    assert again == r
    assert dump_recipe(again) == text


def write(tmp_path, data, name="r.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def test_overrides_apply_before_validation_and_are_recorded(tmp_path):
    path = write(tmp_path, {**BASE, "modifiers": ["FuseNorm<untie:false>"]})
    loaded = load_recipe(path, ["calibration.samples=32", "modifiers.0.untie=true", "output=elsewhere"])
    r = loaded.recipe
    assert r.calibration.samples == 32 and r.modifiers[0].untie is True and r.output == "elsewhere"
    assert r.overrides == ["calibration.samples=32", "modifiers.0.untie=true", "output=elsewhere"]
    # the resolved recipe loads back equal to itself (overrides are not applied twice)
    assert recipe_from_dict(yaml.safe_load(dump_recipe(r))) == r


def test_override_unknown_path_is_an_error(tmp_path):
    path = write(tmp_path, BASE)
    with pytest.raises(RecipeError, match="unknown path 'calibration.sample'"):
        load_recipe(path, ["calibration.sample=32"])
    with pytest.raises(RecipeError, match="no step 3"):
        load_recipe(path, ["modifiers.3.untie=true"])
    data = {}
    with pytest.raises(RecipeError, match="must look like"):
        apply_override(data, "calibration.samples", "f")
