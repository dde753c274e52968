"""``calibration.offload: auto``: activations stay on an accelerator when recipe plan's estimate fits in 80 %
of its free memory, and go to the host otherwise; ``true``/``false`` are kept as given."""
from __future__ import annotations

import pytest
import torch

from recipe_engine.execution.placement import DEVICE_SHARE, largest_layer_bytes, offload_activations
from recipe_engine.plan.estimates import MemoryPlan, StepMemory
from recipe_engine.recipe.schema import CalibrationConfig
from tests.helpers import tiny_model

GIB = 2**30
MEMORY = MemoryPlan(streamed=False, on_device=False, runtime_bytes=0, activations_bytes=8 * GIB, model_bytes=0,
                    steps=[StepMemory("A", 0, 20 * GIB, True), StepMemory("B", 0, 4 * GIB, True)], host_peak_bytes=0)


@pytest.mark.parametrize("free_gib,offload", [(80, False), (40, False), (39, True), (20, True)])
def test_auto_keeps_activations_on_the_device_when_the_estimate_fits(monkeypatch, free_gib, offload):
    layer = 1 * GIB  # need: 8 + 20 + 4 × 1 = 32 GiB, against 80 % of the free memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib * GIB, 141 * GIB))
    assert offload_activations("auto", torch.device("cuda"), MEMORY, layer) is offload
    assert (32 > DEVICE_SHARE * free_gib) is offload  # the rule by hand


def test_given_values_are_kept_and_the_host_needs_no_move(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("no device to ask"))
    assert offload_activations(True, torch.device("cuda"), MEMORY, GIB) is True
    assert offload_activations(False, torch.device("cuda"), MEMORY, GIB) is False
    assert offload_activations("auto", torch.device("cpu"), MEMORY, GIB) is True


def test_schema_default_is_auto_and_yaml_booleans_still_read():
    assert CalibrationConfig().offload == "auto"
    assert CalibrationConfig(offload="no").offload is False and CalibrationConfig(offload=True).offload is True
    with pytest.raises(ValueError):
        CalibrationConfig(offload="sometimes")


def test_largest_layer_bytes_counts_meta_parameters_too():
    model = tiny_model(num_hidden_layers=2)
    expected = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    assert largest_layer_bytes(model.model.layers) == expected
    meta = model.to("meta")
    assert largest_layer_bytes(meta.model.layers) == expected


def test_the_resolved_value_is_the_sessions_own_field_and_the_recipe_keeps_auto():
    """The runner resolves ``auto`` into ``Session.offload``; the calibration config (saved with the output as the
    recipe was written) is not rewritten, and siblings (the reference model, branches) share the decision."""
    from recipe_engine.architectures.adapters import adapter_for
    from recipe_engine.execution.context import RunContext
    from recipe_engine.execution.session import Session

    model = tiny_model(num_hidden_layers=2)
    config = CalibrationConfig()
    on_device = Session(RunContext(None, adapter_for(model.config), config, torch.device("meta"), offload=False),
                        model, torch.zeros(2, 8, dtype=torch.long))
    assert on_device.context.storage == torch.device("meta") and config.offload == "auto"
    assert on_device.sibling(model, None).context.storage == torch.device("meta")
    default = Session(RunContext(None, adapter_for(model.config), config, torch.device("meta")),
                      model, torch.zeros(2, 8, dtype=torch.long))
    assert default.context.offload is True and default.context.storage == torch.device("cpu")
