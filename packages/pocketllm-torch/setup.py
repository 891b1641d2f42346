"""Builds the native CPU kernels (csrc/) as ``pocketllm_torch._C``; see pocketllm_torch/native.py.

They are optional: where they cannot be built (no C++ compiler, say), the package installs without them and
uses torch's own kernels. Set POCKETLLM_REQUIRE_NATIVE=1 to make a failed build an error (CI does).
"""

import os
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

SOURCES = [f"csrc/{name}.cpp" for name in ("module", "grouped_linear", "paged_attention", "elementwise",
                                                   "gated_delta")]


# The torch the kernels are compiled against: native.py loads them only under that same torch. Written before
# setup() so that the wheel's Python files include it.
(Path(__file__).parent / "src" / "pocketllm_torch" / "_built_for.py").write_text(
    f'"""Written by setup.py."""\n\nTORCH_VERSION = {torch.__version__!r}\n')


class OptionalBuildExtension(BuildExtension):
    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            if os.environ.get("POCKETLLM_REQUIRE_NATIVE") == "1":
                raise
            self.warn(f"{ext.name} not built, torch's kernels will be used instead: {e}")


setup(
    ext_modules=[
        # -fopenmp makes at::parallel_for run on torch's OpenMP threads (libgomp.so.1, already loaded by torch).
        CppExtension("pocketllm_torch._C", SOURCES, extra_compile_args=["-O3", "-fopenmp"],
                     extra_link_args=["-fopenmp"]),
    ],
    cmdclass={"build_ext": OptionalBuildExtension},
)
