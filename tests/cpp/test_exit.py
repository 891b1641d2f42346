"""A script that uses the cpp backend and exits without shutdown() exits at once, quietly, its engine stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("pocketllm_cpp._native")

SCRIPTS = {
    # The README's library snippet: generate, print, exit.
    "after a generation": """
        import sys
        from pocketllm import LLM
        llm = LLM(sys.argv[1], backend="cpp")
        print(llm.generate([5, 6, 7])[0].outputs[0].token_ids)
        """,
    # Exiting while a request still runs: the engine stops in the middle of it.
    "during a generation": """
        import sys
        from pocketllm import LLM, SamplingParams
        llm = LLM(sys.argv[1], backend="cpp")
        stream = llm.generate_stream([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
        print(next(stream).token_ids)
        """,
}


@pytest.mark.parametrize("when", SCRIPTS)
def test_a_script_that_never_shuts_down_exits_quickly_and_quietly(when: str, pocketllm_tiny_llama: Path) -> None:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPTS[when]), str(pocketllm_tiny_llama)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "POCKETLLM_QUIET": "1"})
    assert done.returncode == 0, done.stderr
    # No nanobind leak report, no traceback from a thread at teardown. (This environment has the suite's own
    # broken plugin installed, which is reported when it loads.)
    assert [line for line in done.stderr.splitlines() if "pocketllm-broken" not in line] == []
    assert done.stdout.startswith("[")
    assert time.perf_counter() - start < 30
