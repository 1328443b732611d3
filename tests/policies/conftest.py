"""The policies' tests' fixtures."""
from __future__ import annotations

import pytest

from support.models import build_tiny


@pytest.fixture(scope="module", params=["llama", "opt"])
def tiny(request, device):
    """Our tiny random Llama and OPT models (conftest.py's build_tiny) on the `device` fixture's device."""
    _, model = build_tiny(request.param)
    return model.to(device)
