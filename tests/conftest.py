"""Shared fixtures: tiny checkpoints of real families, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("COLUMNS", "200")  # rich wraps tables at 80 columns without a terminal

import pytest

from quantize_moe.tiny import build_tiny_checkpoint

SHARED_FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(model_type, **kwargs) -> folder; each distinct request is built once."""
    built: dict = {}

    def build(model_type: str, **kwargs) -> Path:
        key = (model_type, tuple(sorted(kwargs.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"src-{model_type}")
            built[key] = build_tiny_checkpoint(model_type, folder, **kwargs)
        return built[key]

    return build


@pytest.fixture
def shared_fixtures() -> Path:
    if not (SHARED_FIXTURES / "tiny-mixtral-trained").is_dir():
        pytest.skip("../shared/fixtures is not present")
    return SHARED_FIXTURES
