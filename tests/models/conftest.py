import pytest

from reinforge.models import save_tiny_model


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def tiny_model_dir(request, tmp_path_factory):
    """A saved tiny model + char tokenizer folder, once per architecture."""
    return save_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}") / "model", arch=request.param)
