"""Fixtures shared by the environment tests."""

import pytest

from textrl.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    """The tiny tokenizer (built once per module)."""
    return build_tiny_tokenizer()
