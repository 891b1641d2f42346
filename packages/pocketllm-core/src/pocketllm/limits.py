"""Limits the core enforces at its boundary, each defined once and imported wherever it is needed."""

from __future__ import annotations

MAX_MODEL_LEN_CAP = 8192
"""``max_model_len`` when none is given: the model's own limit, capped here (KV memory grows with it)."""

MAX_LOGPROBS = 20
"""Most top alternatives a request may ask for (OpenAI's limit); a backend may declare fewer."""

MAX_N = 16
"""Most choices one request may fan out to; a backend may declare fewer."""

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Seeds and other integers that reach native code must fit a signed 64-bit integer."""

MAX_LOGIT_BIAS = 100.0
"""logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI's API says."""

MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 2.0
"""A repetition penalty divides logits: near zero it would turn them into infinities."""

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
"""Stop strings are searched after every token, and the longest one is held back from streams."""

MAX_STOP_TOKEN_IDS = 1024

MAX_GRAMMAR_CHARS = 1 << 20
"""A structured-output spec (JSON schema, regex, grammar) is compiled per distinct spec: 1 MiB of text at most."""

MAX_THREADS = 1024
"""Most compute threads a backend option may ask for: a typo of 10**6 must be an error, not a million threads."""
