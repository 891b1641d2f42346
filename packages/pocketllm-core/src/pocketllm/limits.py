"""Limits the core enforces at its boundary, each defined once and imported wherever it is needed."""

from __future__ import annotations

MAX_MODEL_LEN_CAP = 8192
"""``max_model_len`` when none is given: the model's own limit, capped here (KV memory grows with it)."""

MAX_LOGPROBS = 20
"""Most top alternatives a request may ask for (OpenAI's limit); a backend may declare fewer."""

MAX_N = 16
"""Most choices one request may fan out to; a backend may declare fewer."""

MAX_PROMPT_LOGPROB_ENTRIES = 1 << 17
"""Most prompt logprobs one prompt may ask for, counted as prompt tokens x (``prompt_logprobs`` + 1) x ``n``: each
is a token with its logprob and rank, ~100 bytes of JSON in a reply, and every choice scores its prompt again. 600
prompt tokens with 20 alternatives for 16 choices came to 19 MB and 28 s here."""

MAX_REQUEST_PROMPT_LOGPROB_ENTRIES = 1 << 20
"""The same, summed over the prompts of one HTTP request (a completions request may hold 2,048): lm-eval's batched
loglikelihood requests (echo with one alternative: 2 a token) fit 128 prompts of 4,096 tokens."""

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

MAX_SCHEMA_DEPTH = 512
"""Deepest nesting of JSON objects in a JSON schema, each ``$ref`` counted as the depth of what it points to (a
reference back into its own path is a recursive schema, which adds nothing). llguidance compiles a schema by
recursion, 3-5 KB of stack per level: a ``$defs`` chain of 1,000 ``$ref`` links (3,000 levels) overflowed an
8 MiB thread stack and killed the process."""

MAX_GRAMMAR_RULES = 1000
"""Most rules in a Lark or GBNF grammar, each bracketed group counted as the rule it becomes. llguidance walks a
chain of rules by recursion, 2-5 KB of stack per rule: 3,000 chained rules overflowed an 8 MiB thread stack."""

MAX_GRAMMAR_ALTERNATIVES = 2000
"""Most alternatives in one rule or group of a grammar, and most options of a ``choice``: llguidance's parser
holds a rule's alternatives in one row of at most this many items (its ``max_items_in_row``), and a request whose
grammar passes it fails after its first token."""

MAX_SCHEMA_OBJECT_PROPERTIES = 500
"""Most properties of a JSON schema object, counting those its allOf, anyOf and oneOf branches add. Where it may
choose among several (no required property yet, or those after the last required one), llguidance offers one
alternative per property, about 4 items each in its parser's row, whose size it bounds by MAX_GRAMMAR_ALTERNATIVES:
503 optional properties failed as the object opened, 1,200 after a required first one failed after it, and two
anyOf branches of 400 each as well (a request then failed or not by the tokens it sampled)."""

MAX_GBNF_CHARS = 128 << 10
"""A GBNF grammar's length at most: llguidance converts GBNF to Lark in Python, holding the GIL, at ~20 us per
character here (a 417 KB grammar took 8 s even with its rules in dependency order); at this length about 2.5 s."""

MAX_GRAMMAR_REPEAT = 10_000
"""Largest repetition count (``{n}``, ``{n,m}``) in a regex or grammar, nested counts multiplied: llguidance
expands a counted repetition, a forced one of 10,000 costs ~10 ms of mask per token (a decode step's worth), and
one of 40,000 (GBNF's ``"a"{1000000}`` all the more) fails after the first token."""

MAX_GRAMMAR_CACHE_MB = 1 << 20
"""grammar_cache_mb at most: a TiB, so that a typo is an error and the bytes fit any integer they meet."""

GRAMMAR_COMPILE_STACK_BYTES = 64 << 20
"""Stack of each thread that compiles grammars. Every shape tried at the bounds above (1,000 chained rules, 512
levels of $ref chains through properties, items, prefixItems or anyOf, and a 995-rule chain ending in such a
%json) compiled within 4 MiB and overflowed 2 MiB: this leaves a sixteenfold margin. Only touched pages are
committed."""

GRAMMAR_COMPILE_THREADS = 2
"""Threads that compile grammars, per engine: a compile keeps a core busy (llguidance releases the GIL), and more
at once would slow the engine's steps."""

MAX_QUEUED_GRAMMAR_COMPILES = 16
"""Distinct grammar compiles that may wait for a compile thread, per engine; one more is refused as overloaded
(503 with Retry-After). Requests for a spec already being compiled wait for that compile and do not count."""

GRAMMAR_COMPILE_TIMEOUT_S = 10.0
"""How long a request waits for its grammar's compile, from the compile's start (a ConfigError naming the limit
past it, a 400), or for a compile thread while queued (overloaded, a 503). Under the bounds above most compiles
take milliseconds; a 345 KB schema of 8,600 optional properties took 19.5 s here."""

MAX_THREADS = 1024
"""Most compute threads a backend option may ask for: a typo of 10**6 must be an error, not a million threads."""

MAX_SPECULATIVE_TOKENS = 16
"""Most tokens drafted per sequence and step (``EngineArgs.num_speculative_tokens``): past a handful, drafts are
rarely accepted in full, and each drafted token costs a verification row."""
MAX_NGRAM = 64
"""Longest n-gram the ``ngram`` drafter looks up (``EngineArgs.ngram_max``)."""
