"""One reader of percentages for every recipe field that takes one: layer budgets, BestOf's size budget and
WidthPrune's ``parameters``; exact arithmetic where floats round the wrong way."""
import math
from fractions import Fraction

import pytest
from pydantic import ValidationError

from recipe_engine.api import share_of
from recipe_engine.recipe.budget import byte_count, percentage, resolve_budget
from recipe_engine.modifiers.best_of import SizeBudget
from recipe_engine.modifiers.width_prune import WidthPrune
from recipe_engine.modifiers.shortgpt import ShortGPT


def test_percentage_reads_plain_and_spaced_numbers_exactly():
    assert percentage("20%") == 20
    assert percentage(" 12.5 % ") == Fraction(25, 2)
    for text in ("20", "1e1%", "-5%", "%", "twenty%", 20, None):
        assert percentage(text) is None


def test_share_of_is_exact_where_floats_fall_below_the_integer():
    # 70 % of 90 is 63; in floats 0.7 * 90 = 62.99999999999999, whose floor is 62
    assert math.floor(70.0 / 100 * 90) == 62
    assert share_of("70%", 90) == 63
    assert SizeBudget(parameters="70%").parameter_limit(90) == 63
    assert SizeBudget(parameters="57.5%").parameter_limit(200) == 115


def test_byte_counts_read_decimal_and_binary_units_down_to_whole_bytes():
    assert byte_count(400_000_000) == byte_count("400MB") == byte_count(" 0.4 GB ") == 400_000_000
    assert byte_count("381.5MiB") == 381 * 2**20 + 2**19 and byte_count("1.0000001KiB") == 1024
    assert SizeBudget(weight_bytes="50%").byte_limit(1001) == 500
    assert SizeBudget(weight_bytes="1GiB").byte_limit(10) == 2**30  # a count does not depend on the model
    for text in ("0", "0.1B", "-5MB", "5 XB", "5mb", 0, -3, True, None, 1.5):
        assert byte_count(text) is None


@pytest.mark.parametrize("make", [lambda v: ShortGPT(n=v), lambda v: SizeBudget(parameters=v),
                                  lambda v: SizeBudget(weight_bytes=v),
                                  lambda v: WidthPrune(parameters=v)])
def test_every_percentage_field_refuses_the_same_way(make):
    for bad in ("0%", "abc", "1e1%", "150%"):
        with pytest.raises(ValidationError, match="a percentage in"):
            make(bad)
    assert percentage(str(_written(make(" 20 %")))) == 20


def test_only_the_size_budget_accepts_the_whole():
    assert SizeBudget(parameters="100%").parameters == "100%"
    for make in (lambda: ShortGPT(n="100%"), lambda: WidthPrune(parameters="100%")):
        with pytest.raises(ValidationError, match=r"\(0%, 100%\)"):
            make()


def test_layer_budget_rounds_half_up_on_the_exact_share():
    assert resolve_budget("20%", 30) == 6
    assert resolve_budget("12.5%", 12) == 2  # 1.5 exactly, rounded up
    assert resolve_budget("25%", 30) == 8    # 7.5 exactly, rounded up


def _written(step):
    return getattr(step, "n", None) or getattr(step, "parameters", None) or getattr(step, "weight_bytes")
