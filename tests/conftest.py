"""Shared pytest fixtures."""
import os
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _shared_tokenizers() -> Path:
    env = os.environ.get("MRL_SHARED_TOKENIZERS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "tokenizers"


@pytest.fixture(scope="session")
def shared_tokenizers_dir() -> Path:
    """Folder of real Hugging Face tokenizer.json files (../shared/tokenizers); skips when absent."""
    path = _shared_tokenizers()
    if not path.is_dir():
        pytest.skip(f"real tokenizers not available at {path} (set MRL_SHARED_TOKENIZERS)")
    return path
