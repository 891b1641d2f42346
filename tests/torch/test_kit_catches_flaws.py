"""The conformance kit fails a backend that breaks a rule, in the test that names the rule.

The flawed backends (tests/fixtures/pocketllm-flawed) are the torch backend with one rule broken each.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pocketllm_flawed")

KIT_MODULE = """
from pocketllm.testing import ProtocolConformance

class TestFlawed(ProtocolConformance):
    backend = "{backend}"
    engine_kwargs = {{"dtype": "float32"}}
"""


@pytest.mark.parametrize(("backend", "broken_rule"), [
    ("flawed-seed", "test_seeds"),
    ("flawed-seed", "test_seeded_sampling_ignores_the_rest_of_the_batch"),
    ("flawed-batch", "test_seeded_sampling_ignores_the_rest_of_the_batch"),
    ("flawed-abort", "test_abort_queued_request"),
])
def test_kit_fails_the_test_that_names_the_broken_rule(pytester: pytest.Pytester, backend: str,
                                                       broken_rule: str) -> None:
    pytester.makepyfile(test_flawed=KIT_MODULE.format(backend=backend))
    # The broken rule's test, and one the backend keeps, so that a kit failing everything would be noticed.
    # In a subprocess: an inline run would import torch a second time into this interpreter.
    selected = f"{broken_rule} or test_stop_token_ids"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-k", selected)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"FAILED test_flawed.py::TestFlawed::{broken_rule}*"])
