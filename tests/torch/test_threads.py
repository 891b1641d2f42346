"""The torch backend's threads: the default count is the CPUs this process may use, and waiting does not spin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("pocketllm_torch")

from pocketllm_torch.cpus import available_cpus, cgroup_cpu_quota
from tests.cgroup_trees import QUOTA_CASES, cgroup_tree

needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs os.sched_setaffinity and two CPUs")


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _clean_env() -> dict[str, str]:
    """This environment without the variables that choose OpenMP's threads or waiting."""
    return {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


@needs_two_cpus
def test_the_default_thread_count_honours_the_affinity_mask(pocketllm_tiny_llama: Path) -> None:
    # torch counts its threads when it loads: a mask narrowed afterwards (or a cgroup quota) is the engine's to see.
    # The engine sets them on its own thread, which runs the kernels (a thread's OpenMP count is its own).
    out = _run("""
        import os, sys, torch
        before = torch.get_num_threads()
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        from pocketllm import LLM
        for options in ({}, {"num_threads": 2}):
            llm = LLM(sys.argv[1], backend="torch", dtype="float32", backend_options=options)
            print(llm.backend_engine.config.num_threads)
            llm.shutdown()
        print(before)
        """, str(pocketllm_tiny_llama), env=_clean_env())
    default, chosen, before = map(int, out.split())
    if before < 2:
        pytest.skip("torch's own default is one thread here (one physical core)")
    assert (default, chosen) == (1, 2)


@pytest.mark.parametrize(("cgroup", "mounts", "files", "expected"), QUOTA_CASES)
def test_the_cgroup_cpu_quota_caps_the_cpus(cgroup: str, mounts: list[str], files: dict[str, str], expected: float,
                                            tmp_path: Path) -> None:
    root = cgroup_tree(tmp_path, cgroup, mounts, files)
    assert cgroup_cpu_quota(root) == pytest.approx(expected)
    mask = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert available_cpus(root) == (min(mask, -int(-expected // 1)) if expected else mask)


@contextmanager
def _busy(cpus: set[int]) -> Iterator[None]:
    """One process spinning on each of ``cpus``."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in cpus]
    try:
        for burner, cpu in zip(burners, sorted(cpus), strict=True):
            os.sched_setaffinity(burner.pid, {cpu})
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


@needs_two_cpus
def test_two_threads_beside_busy_processes_do_not_collapse(pocketllm_kit_checkpoint: Callable[[str], Path]) -> None:
    """Two threads on two CPUs that two other processes keep busy. OpenMP threads that spin after each parallel
    region (libgomp's default) hold the CPU the thread they wait for needs: 64 tokens of the kit's GGUF took 10-30
    times as long as with one thread here; sleeping at once, less than one thread's time. The policy is torch's
    alone: the environment, which the processes this one starts inherit, is left without it."""
    cpus = set(sorted(os.sched_getaffinity(0))[:2])
    script = """
        import os, sys, time
        os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(",")})
        from pocketllm import LLM, SamplingParams
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for threads in (1, 2):
            llm = LLM(sys.argv[1], backend="torch", dtype="float32", backend_options={"num_threads": threads})
            llm.generate([5, 6, 7], params)
            start = time.perf_counter()
            llm.generate([5, 6, 7], params)
            print(time.perf_counter() - start)
            llm.shutdown()
        print(os.environ.get("OMP_WAIT_POLICY"))
        """
    with _busy(cpus):
        out = _run(script, str(pocketllm_kit_checkpoint("llama-gguf")), ",".join(map(str, cpus)), env=_clean_env())
    one, two, policy = out.split()
    assert policy == "None"
    assert float(two) < 3 * float(one) + 0.25, (one, two)


def test_a_chosen_openmp_wait_policy_is_kept() -> None:
    out = _run("import os, pocketllm_torch; print(os.environ.get('OMP_WAIT_POLICY'))",
               env=_clean_env() | {"GOMP_SPINCOUNT": "10000"})
    assert out == "None"
