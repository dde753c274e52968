"""``calibration.offload: auto``: activations stay on an accelerator when recipe plan's estimate fits in 80 %
of its free memory, and go to the host otherwise; ``true``/``false`` are kept as given."""
from __future__ import annotations

import pytest
import torch

from recipe_engine.execution.placement import DEVICE_SHARE, largest_layer_bytes, offload_activations
from recipe_engine.recipe.schema import CalibrationConfig
from tests.helpers import tiny_model

GIB = 2**30
MEMORY = {"activations_bytes": 8 * GIB, "steps": [{"working_bytes": 20 * GIB}, {"working_bytes": 4 * GIB}]}


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
