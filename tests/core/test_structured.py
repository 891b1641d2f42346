"""Structured-output specs: exactly one constraint, checked at the boundary; grammars compiled once per spec."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from pocketllm.errors import ConfigError
from pocketllm.limits import MAX_SCHEMA_OBJECT_PROPERTIES
from pocketllm.structured import GrammarCompiler, StructuredOutputs, bitmask_words
from pocketllm.testing.checkpoints import make_tiny_llama
from pocketllm.tokenizer import Tokenizer


def optional_properties(n: int, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)},
            "required": list(required)}


@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": [""]},
                                    {"json": {"type": "object"}, "json_object": True},
                                    {"grammar": "x" * (1 << 20 + 1)}])
def test_a_spec_sets_exactly_one_sane_constraint(fields: dict) -> None:
    with pytest.raises(ConfigError, match="structured_outputs"):
        StructuredOutputs(**fields)


def test_a_schema_nested_ten_thousand_deep_is_a_config_error() -> None:
    schema: dict = {}
    inner = schema
    for _ in range(10_000):
        inner["items"] = {}
        inner = inner["items"]
    with pytest.raises(ConfigError, match=r"structured_outputs.*nested too deeply"):
        StructuredOutputs(json=schema)


# Compiles each shape of tests/core/grammar_shapes.py, printing "name: ok" or "name: <error>"; a stack overflow in
# llguidance kills this process, which is why it is one.
_COMPILE_SHAPES = """
import sys
from pocketllm.checkpoint import load_checkpoint
from pocketllm.structured import GrammarCompiler, StructuredOutputs
from pocketllm.tokenizer import Tokenizer
from tests.core.grammar_shapes import AT_THE_BOUNDS, PAST_THE_BOUNDS

checkpoint = load_checkpoint(sys.argv[1])
compiler = GrammarCompiler(Tokenizer.from_checkpoint(checkpoint), checkpoint.config.vocab_size)
for name, fields, *_ in AT_THE_BOUNDS + PAST_THE_BOUNDS:
    try:
        compiler.constraint(StructuredOutputs(**fields))
        print(f"{name}: ok", flush=True)
    except Exception as e:
        print(f"{name}: {e}", flush=True)
"""


def test_deep_but_flat_grammars_compile_or_are_refused_and_never_crash(tmp_path: Path) -> None:
    """Issue 31, item 1: $ref chains of 1,000 links and 3,000 chained Lark rules overflowed the compiling thread's
    stack (SIGSEGV). Every shape just inside the bounds compiles; the issue's shapes and ten times each bound are
    ConfigErrors naming the limit."""
    from tests.core.grammar_shapes import AT_THE_BOUNDS, PAST_THE_BOUNDS

    tiny = make_tiny_llama(tmp_path / "tiny")
    done = subprocess.run([sys.executable, "-c", _COMPILE_SHAPES, str(tiny)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, f"exit {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    results = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    for name, _ in AT_THE_BOUNDS:
        assert results[name] == "ok", name
    for name, _, limit in PAST_THE_BOUNDS:
        assert results[name].startswith("structured_outputs: ") and limit in results[name], (name, results[name])


@pytest.mark.parametrize(("fields", "limit"), [
    ({"json": {"$ref": "#"}}, "$ref cycle"),
    ({"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
               "$ref": "#/$defs/a"}}, "$ref cycle"),
    ({"regex": "(a{1000}){1000}"}, "repetition count of 1000000"),
    ({"grammar": 'root ::= "a"{1000000}'}, "repetition count of 1000000"),
    ({"grammar": 'start: ("a" ~ 200){100}'}, "repetition count of 20000"),
    ({"json": {"type": "string", "pattern": "[a-z]{100000}"}}, "repetition count of 100000"),
    ({"grammar": "start: " + " | ".join(f'"a{i}"' for i in range(2001))}, "more than 2000 alternatives"),
    ({"grammar": "start: (" + " | ".join(f'"a{i}"' for i in range(2001)) + ")"}, "more than 2000 alternatives"),
    ({"grammar": 'root ::= "' + "a" * (1 << 18) + '"'}, "GBNF grammar is longer than 131072 characters"),
    ({"json": optional_properties(MAX_SCHEMA_OBJECT_PROPERTIES + 1)}, "has 501 properties"),
    ({"json": {"type": "array", "items": optional_properties(600)}}, "has 600 properties"),
    ({"json": optional_properties(1200, required=("p0",))}, "has 1200 properties"),
    *(({"json": {combinator: [optional_properties(400), optional_properties(400)]}}, "has 800 properties")
      for combinator in ("anyOf", "allOf", "oneOf")),
    ({"json": {"$defs": {"half": optional_properties(300)}, "allOf": [{"$ref": "#/$defs/half"}],
               **optional_properties(300)}}, "has 600 properties"),
])
def test_grammars_past_a_bound_are_refused_before_compiling(compiler: GrammarCompiler, fields: dict,
                                                             limit: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(limit)):
        compiler.constraint(StructuredOutputs(**fields))


def test_recursive_schemas_and_wide_grammars_within_the_bounds_compile(compiler: GrammarCompiler) -> None:
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}
    linked = {"$defs": {"node": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}}, "$ref": "#/$defs/node"}
    for fields in ({"json": tree}, {"json": linked}, {"regex": "(ab){5}[0-9]{1,3}(x{10}){100}"},
                   {"grammar": "start: (" + " | ".join(f'"a{i}"' for i in range(1999)) + ")"},
                   {"grammar": 'root ::= [a-z]{3,5} ("x" | "y"){2,}'}):
        compiler.constraint(StructuredOutputs(**fields))


def test_objects_of_optional_properties_within_the_bound_open_and_go_on(compiler: GrammarCompiler) -> None:
    """llguidance offers the properties an object may go on with as one alternative each: 503 optional ones failed
    its row bound as the object opened (a request then failed or not by the tokens it sampled), 1,200 after a
    required first one failed after it. At the bound, each of these opens and goes on."""
    half = MAX_SCHEMA_OBJECT_PROPERTIES // 2
    for schema, text in ((optional_properties(MAX_SCHEMA_OBJECT_PROPERTIES), '{"p'),
                         (optional_properties(MAX_SCHEMA_OBJECT_PROPERTIES, required=("p0",)), '{"p0":"a","p'),
                         ({"anyOf": [optional_properties(half), optional_properties(half)]}, '{"p')):
        constraint = compiler.constraint(StructuredOutputs(json=schema))
        for token in compiler._tokenizer.encode(text, add_special_tokens=False):
            assert allowed(compiler, constraint) and constraint.error is None
            constraint.accept(token)
        assert any(t.startswith("1") for t in allowed(compiler, constraint)) and constraint.error is None


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> GrammarCompiler:
    from pocketllm.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(str(make_tiny_llama(tmp_path_factory.mktemp("tiny"))))
    return GrammarCompiler(Tokenizer.from_checkpoint(checkpoint), checkpoint.config.vocab_size)


def allowed(compiler: GrammarCompiler, constraint) -> set[str]:
    mask = np.zeros(bitmask_words(compiler.vocab_size), np.int32)
    constraint.fill_bitmask(mask)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:compiler.vocab_size]
    return {compiler._tokenizer.decode([int(t)], skip_special_tokens=False) for t in np.flatnonzero(bits)}


@pytest.mark.parametrize("spec", [StructuredOutputs(regex="ab+"), StructuredOutputs(grammar='start: "ab" "b"*'),
                                  StructuredOutputs(grammar='root ::= "ab" "b"*')])
def test_regex_lark_and_gbnf_constrain_the_next_token(compiler: GrammarCompiler, spec: StructuredOutputs) -> None:
    constraint = compiler.constraint(spec)
    first = allowed(compiler, constraint)
    assert first and all("ab".startswith(t) or t.startswith("ab") for t in first), first
    token = compiler._tokenizer.encode("a", add_special_tokens=False)[0]
    constraint.accept(token)
    assert all(set(t) <= {"b"} for t in allowed(compiler, constraint))


def test_each_request_gets_its_own_state_from_one_compiled_grammar(compiler: GrammarCompiler) -> None:
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    first, second = compiler.constraint(spec), compiler.constraint(StructuredOutputs(json=dict(spec.json)))
    assert len([k for k in compiler._cache if '"a"' in k]) == 1  # one compile for the equal specs
    first.accept(compiler._tokenizer.encode("{", add_special_tokens=False)[0])
    assert "{" in "".join(allowed(compiler, second))  # the other request has not moved


@pytest.mark.parametrize("spec", [StructuredOutputs(json={"type": "nope"}), StructuredOutputs(regex="(open"),
                                  StructuredOutputs(json="{not json"),
                                  StructuredOutputs(grammar="start: missing_rule")])
def test_bad_grammars_are_config_errors(compiler: GrammarCompiler, spec: StructuredOutputs) -> None:
    with pytest.raises(ConfigError, match="structured_outputs"):
        compiler.constraint(spec)


@pytest.mark.parametrize(("fields", "words"), [
    ({"regex": "[^\\s\\S]"}, "the regex matches no text at all"),
    ({"grammar": 'start: a\na: a "x"'}, "the grammar matches no text at all"),
    ({"json": {"allOf": [{"$ref": "#"}]}}, "$ref cycle"),
    ({"choice": ["no", "<|im_end|>"]}, "choice 1 holds '<|im_end|>'"),
    ({"grammar": 'start: "x<|im_start|>"'}, "'<|im_start|>', which the model writes only as a special token"),
    ({"regex": "a(?=b)" + "c" * 5000}, "invalid regex"),
    ({"grammar": "start: " + "(" * 300 + '"a"' + ")" * 300}, "invalid grammar"),
    # A regex's parse error heads its detail with a colon: the reason is kept, not only the heading.
    ({"json": {"type": "string", "pattern": "(unclosed"}}, "unclosed group"),
    ({"regex": "[a-"}, "unclosed character class"),
])
def test_grammar_mistakes_are_short_config_errors(compiler: GrammarCompiler, fields: dict, words: str) -> None:
    """Issue 31, item 6: each failed in the engine once the request ran, or answered with llguidance's parser
    state and the client's grammar at length."""
    with pytest.raises(ConfigError, match="structured_outputs") as error:
        compiler.constraint(StructuredOutputs(**fields))
    assert words in str(error.value) and len(str(error.value)) < 300, str(error.value)


def test_a_token_after_the_complete_grammar_is_an_error(compiler: GrammarCompiler) -> None:
    """What a backend samples when min_tokens bans the end of a complete grammar is not the grammar's."""
    eos = compiler._tokenizer.eos_token_ids[0]
    constraint = compiler.constraint(StructuredOutputs(choice=["ab"]))
    for token in compiler._tokenizer.encode("ab", add_special_tokens=False):
        constraint.accept(token)
    assert constraint.complete and constraint.error is None
    constraint.accept(eos)
    assert constraint.error is None
    constraint.accept(compiler._tokenizer.encode("a", add_special_tokens=False)[0])
    assert constraint.error is not None and "after the grammar was complete" in constraint.error


def test_the_cache_is_bounded_by_bytes_and_keeps_no_failed_compile(compiler: GrammarCompiler) -> None:
    """Issue 31, item 2: bounded by entry count (256), distinct large specs held their full size each."""
    from pocketllm.structured import estimated_bytes

    specs = [StructuredOutputs(regex=f"x{i:02}" + "[a-z]" * 600) for i in range(12)]
    each = estimated_bytes(specs[0])
    small = GrammarCompiler(compiler._tokenizer, compiler.vocab_size, cache_bytes=4 * each + each // 2)
    for spec in specs:
        small.constraint(spec)
    stats = small.cache_stats()
    assert stats.num_entries == 4 and stats.num_bytes == 4 * each <= stats.capacity_bytes
    assert [k for k in small._cache] == [spec.key() for spec in specs[-4:]]  # least recently used out first
    small.constraint(specs[-4])  # a hit moves it to the end
    assert next(reversed(small._cache)) == specs[-4].key()
    with pytest.raises(ConfigError):
        small.constraint(StructuredOutputs(regex="(unclosed"))
    with pytest.raises(ConfigError):
        small.constraint(StructuredOutputs(grammar='start: a\na: a "x"'))  # compiles, then fails its first mask
    huge = StructuredOutputs(regex="y" * (5 * each // 500))  # its estimate passes the whole capacity
    small.constraint(huge)
    assert small.cache_stats() == stats and huge.key() not in small._cache
    nothing = GrammarCompiler(compiler._tokenizer, compiler.vocab_size, cache_bytes=0)
    nothing.constraint(specs[0])
    assert nothing.cache_stats().num_entries == 0


def test_grammar_cache_mb_is_checked() -> None:
    from pocketllm.args import EngineArgs

    assert EngineArgs().grammar_cache_mb == 64
    assert EngineArgs.from_env({"POCKETLLM_GRAMMAR_CACHE_MB": "0"}).grammar_cache_mb == 0
    for bad in (-1, 1.5, True, 1 << 40):
        with pytest.raises(ConfigError, match="grammar_cache_mb"):
            EngineArgs(grammar_cache_mb=bad)


def test_compiles_share_threads_queue_boundedly_and_give_up_on_time(compiler: GrammarCompiler,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31, item 3: one compile thread, one queued compile; compiles of "held" regexes wait for an event."""
    from concurrent.futures import ThreadPoolExecutor

    from pocketllm.errors import OverloadedError
    from pocketllm.grammar_pool import CompilePool
    from pocketllm.limits import GRAMMAR_COMPILE_STACK_BYTES

    grammars = GrammarCompiler(compiler._tokenizer, compiler.vocab_size)
    grammars._pool = CompilePool(1, 1, GRAMMAR_COMPILE_STACK_BYTES, name="test-grammar")
    release, started, compile = threading.Event(), threading.Semaphore(0), grammars._compile
    threads: set[str] = set()

    def held(spec: StructuredOutputs):
        threads.add(threading.current_thread().name)
        if spec.regex.startswith("held"):
            started.release()
            release.wait(60)
        return compile(spec)

    monkeypatch.setattr(grammars, "_compile", held)
    with ThreadPoolExecutor(4) as callers:
        first = [callers.submit(grammars.compile, StructuredOutputs(regex="held-a")) for _ in range(2)]
        assert started.acquire(timeout=30)
        queued = callers.submit(grammars.compile, StructuredOutputs(regex="held-b"))
        while grammars._pool.queued() < 1:
            threading.Event().wait(0.01)
        with pytest.raises(OverloadedError, match="1 grammar compiles are waiting"):
            grammars.compile(StructuredOutputs(regex="c"))
        release.set()
        assert first[0].result() is first[1].result()  # one compile for both
        queued.result()
    assert threads == {"test-grammar-0"}  # the pool's own thread, with its large stack
    release.clear()
    grammars.timeout_s = 0.3
    with pytest.raises(ConfigError, match=r"took more than 0.3 s to compile \(the limit\)"):
        grammars.compile(StructuredOutputs(regex="held-slow-1"))  # given up: its thread still runs it
    with pytest.raises(ConfigError, match=r"took more than 0\.3 s"):
        grammars.compile(StructuredOutputs(regex="held-slow-2"))  # on a spare thread: one spare per worker
    with pytest.raises(OverloadedError, match=r"waited 0.3 s for a compile thread"):
        grammars.compile(StructuredOutputs(regex="d"))  # both threads are taken by given-up compiles
    release.set()
    assert grammars.compile(StructuredOutputs(regex="e")) is not None
    assert not any("held-slow" in key for key in grammars._cache)


def test_a_reasoning_section_is_left_free_and_the_grammar_starts_after_it(compiler: GrammarCompiler) -> None:
    """deepseek_r1: the template opened the section, so every token is allowed until the closing tag's tokens."""
    spec = StructuredOutputs(regex="ab+")
    free = allowed(compiler, compiler.constraint(StructuredOutputs(regex="(.|\n)*")))
    constrained = allowed(compiler, compiler.constraint(spec))
    gated = compiler.constraint(spec, "deepseek_r1")
    tokenizer = compiler._tokenizer
    for token in tokenizer.encode("think about b, not a", add_special_tokens=False):
        assert allowed(compiler, gated) == free | allowed(compiler, gated)  # nothing masked
        gated.accept(token)
    for token in tokenizer.encode("so</think>", add_special_tokens=False):  # the tag in whatever tokens
        gated.accept(token)
    assert allowed(compiler, gated) == constrained
    gated.accept(tokenizer.encode("a", add_special_tokens=False)[0])
    assert gated.error is None and all(set(t) <= {"b"} for t in allowed(compiler, gated))


def test_an_optional_section_opens_only_on_the_first_token(compiler: GrammarCompiler) -> None:
    """qwen3: the opening tag's single token is allowed beside the grammar's first tokens; any other first token
    starts the answer (here ids 7 and 8, 9 stand for the tags)."""
    from pocketllm.structured import Constraint, ReasoningGate

    spec = StructuredOutputs(regex="ab+")
    name = compiler._tokenizer.decode([7], skip_special_tokens=False)
    grammar_first = allowed(compiler, compiler.constraint(spec))

    def decode(ids: list[int]) -> str:
        return "".join({8: "</th", 9: "ink>"}.get(t, "x") for t in ids)

    def gated() -> Constraint:
        return Constraint(compiler.constraint(spec)._matcher, compiler.vocab_size, ReasoningGate(False, 7, decode))

    opening = gated()
    assert allowed(compiler, opening) == grammar_first | {name}
    opening.accept(7)
    assert len(allowed(compiler, opening)) > len(grammar_first) + 1  # reasoning: free
    opening.accept(8)
    opening.accept(9)
    assert allowed(compiler, opening) == grammar_first
    answering = gated()
    answering.accept(compiler._tokenizer.encode("a", add_special_tokens=False)[0])
    assert name not in allowed(compiler, answering) or "b" in name
    assert all(set(t) <= {"b"} for t in allowed(compiler, answering))


def test_pooling_params_are_checked_at_the_boundary() -> None:
    from pocketllm.pooling import PoolingParams

    for fields in ({"pooling_type": "max"}, {"normalize": "yes"}, {"dimensions": 0}, {"dimensions": True},
                   {"dimensions": 1.5}):
        with pytest.raises(ConfigError, match=next(iter(fields))):
            PoolingParams(**fields)
