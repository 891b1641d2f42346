"""The cpp backend's threads: the default count is the CPUs this process may use, and waiting does not spin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cgroup_trees import QUOTA_CASES, cgroup_tree

_native = pytest.importorskip("pocketllm_cpp._native")


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")
def test_the_default_thread_count_honours_the_affinity_mask(pocketllm_tiny_llama: Path) -> None:
    # Pinned to one CPU before anything starts: the kernels' pool and an engine without num_threads take one thread.
    out = _run("""
        import os, sys
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        from pocketllm import LLM
        from pocketllm_cpp import _native, kernels
        llm = LLM(sys.argv[1], backend="cpp", show_progress=False)
        print(_native.available_cpus(), kernels.num_threads(), llm.backend_engine.num_threads)
        llm.shutdown()
        """, str(pocketllm_tiny_llama))
    assert out == "1 1 1"
    assert _native.available_cpus() == min(len(os.sched_getaffinity(0)), _native.available_cpus())


@pytest.mark.parametrize(("cgroup", "mounts", "files", "expected"), QUOTA_CASES)
def test_the_cgroup_cpu_quota(cgroup: str, mounts: list[str], files: dict[str, str], expected: float,
                              tmp_path: Path) -> None:
    assert _native.cgroup_cpu_quota(str(cgroup_tree(tmp_path, cgroup, mounts, files))) == pytest.approx(expected)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")
def test_more_threads_than_cpus_do_not_collapse(pocketllm_tiny_llama: Path) -> None:
    # Four threads pinned to one CPU, the worst case of contention: every region waits for threads that are not
    # running. A pool whose waiting threads spin took a scheduler time slice per region (about 100 times as long
    # as one thread); one that yields and then sleeps stays within a small factor.
    out = _run("""
        import os, sys, time
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        from pocketllm import LLM, SamplingParams
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for threads in (1, 4):
            llm = LLM(sys.argv[1], backend="cpp", show_progress=False, backend_options={"num_threads": threads})
            llm.generate([5, 6, 7], params)
            start = time.perf_counter()
            llm.generate([5, 6, 7], params)
            print(time.perf_counter() - start)
            llm.shutdown()
        """, str(pocketllm_tiny_llama))
    one, four = map(float, out.split())
    assert four < 8 * one + 0.25, (one, four)
