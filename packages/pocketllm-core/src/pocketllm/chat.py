"""The one chat prompt builder shared by the library and the HTTP server."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pocketllm.errors import ConfigError

if TYPE_CHECKING:
    from pocketllm.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# Names a message's reasoning may come under; templates read reasoning_content (gpt-oss's read thinking).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _deepseek_token(name: str) -> str:
    """DeepSeek spells its special tokens with U+FF5C (a fullwidth bar) around names whose spaces are U+2581."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


DEEPSEEK_BOS = _deepseek_token("begin of sentence")
DEEPSEEK_EOS = _deepseek_token("end of sentence")
_DS_USER, _DS_ASSISTANT = _deepseek_token("User"), _deepseek_token("Assistant")
_DS_OUTPUTS_BEGIN, _DS_OUTPUTS_END = _deepseek_token("tool outputs begin"), _deepseek_token("tool outputs end")
_DS_OUTPUT_BEGIN, _DS_OUTPUT_END = _deepseek_token("tool output begin"), _deepseek_token("tool output end")

# For a template that does not render tools, what llama.cpp's server does: the tools go in a system message that
# asks for replies in its generic JSON format (pocketllm_server's "generic" tool-call parser reads them back).
TOOLS_PROMPT = (
    "You can call these tools: {tools}\n\n"
    'Respond in JSON, either {{"tool_call": {{"name": "<tool name>", "arguments": {{<its arguments>}}}}}} to call a '
    'tool, or {{"response": "<your reply>"}} to reply to the user.'
)
# What tells whether a template renders tools: it renders this conversation the same with and without this tool.
_PROBE_MESSAGES = [{"role": "user", "content": "Hi."}]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "A probe.", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}]


class ChatPromptBuilder:
    """Renders a conversation into the prompt text the model was trained on.

    In order of preference: the checkpoint's jinja chat template (rendered as
    transformers' ``apply_chat_template`` does), DeepSeek's format for
    checkpoints that ship no template but have DeepSeek's special tokens, and
    finally a plain ``role: content`` transcript.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        """Use ``tokenizer``'s template and special tokens; the keyword arguments override them."""
        if tokenizer is not None:
            chat_template = chat_template or tokenizer.chat_template
            bos_token = bos_token or tokenizer.bos_token
            eos_token = eos_token or tokenizer.eos_token
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._template = _compile(chat_template) if chat_template else None
        self._deepseek = (
            self._template is None
            and tokenizer is not None
            and all(tokenizer.token_to_id(t) is not None for t in (_DS_USER, _DS_ASSISTANT))
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text for ``messages``; raises ConfigError for bad messages or a failing template.

        ``continue_final_message``: the reply continues the last message (an assistant's "prefill"), as
        transformers' flag of that name does: the text ends where that message's content ends, without the
        template's end of turn or a new generation prompt."""
        if continue_final_message:
            return _continued(self.render(messages, add_generation_prompt=False, tools=tools,
                                          chat_template_kwargs=chat_template_kwargs), messages)
        messages = validate_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ConfigError("tools", "must be a list of objects")
        if self._template is None:
            if tools:
                raise ConfigError("tools", "this model has no chat template, so it cannot be given tools")
            if self._deepseek:
                return _render_deepseek(messages, add_generation_prompt, self.bos_token or DEEPSEEK_BOS)
            return _render_plain(messages, add_generation_prompt)
        if tools and not self.renders_tools:
            messages, tools = _with_tools_prompt(messages, tools), None
        try:
            return self._render(messages, add_generation_prompt, tools, chat_template_kwargs)
        except Exception as e:  # the template is untrusted code: any failure is a rejected request
            raise ConfigError("messages", f"the chat template failed: {type(e).__name__}: {e}") from None

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the model a request's tools. Where it does not (it renders the same
        with and without them, or fails with them only), :meth:`render` puts them in a system message
        (:data:`TOOLS_PROMPT`) that asks for calls in llama.cpp's generic JSON format."""
        if self._template is None:
            return False

        def probe(tools: list[dict[str, Any]] | None) -> str | None:
            try:
                return self._render(_PROBE_MESSAGES, True, tools, None)
            except Exception:  # the template is untrusted code
                return None

        without = probe(None)
        renders = without is None or probe(_PROBE_TOOLS) not in (None, without)  # unsure: the template's way
        if not renders:
            log.warning("the chat template does not render tools: a request's tools go in a system message that "
                        "asks for calls in the generic JSON format")
        return renders

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None, chat_template_kwargs: dict[str, Any] | None) -> str:
        assert self._template is not None
        return self._template.render(**{
            **(chat_template_kwargs or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        })


def _continued(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` cut where the final message's content ends (the last place the template wrote it)."""
    content = validate_messages(messages)[-1]["content"].rstrip()
    end = text.rfind(content) if content else -1
    if end < 0:
        raise ConfigError("messages", "the final message can only be continued when it has text that the chat "
                                      "template writes out")
    return text[:end + len(content)]


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and return copies whose ``content`` is a string."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages", "must be a non-empty list of message objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ConfigError("messages", f"message {i} must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ConfigError("messages", f"message {i} has role {role!r}; expected one of {sorted(ROLES)}")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""  # an assistant turn that only calls tools
        checked_message = {**message, "content": _text(content, i)}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:  # aliased as transformers does, so any template finds it
            checked_message = {"thinking": reasoning, **checked_message, "reasoning_content": reasoning}
        checked.append(checked_message)
    return checked


def _with_tools_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with :data:`TOOLS_PROMPT` added to the system message (one put first where there is none),
    and each assistant turn's tool calls written into its content in the same format (such a template drops
    them too)."""
    prompt = TOOLS_PROMPT.format(tools=json.dumps(tools, ensure_ascii=False))
    out = [_calls_as_content(m) for m in messages]
    if out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}, *out[1:]]
    return [{"role": "system", "content": prompt}, *out]


def _calls_as_content(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list) or not calls:
        return message
    written = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        function = function if isinstance(function, Mapping) else {}
        arguments = function.get("arguments", {})
        with contextlib.suppress(json.JSONDecodeError):  # OpenAI's messages carry the arguments as JSON text
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        written.append({"name": function.get("name"), "arguments": arguments})
    reply = {"tool_call": written[0]} if len(written) == 1 else {"tool_calls": written}
    content = "\n".join(part for part in (message["content"], json.dumps(reply, ensure_ascii=False)) if part)
    return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": content}


def _text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ConfigError("messages", f"message {index}: only text content parts are supported")
            parts.append(part["text"])
        return "\n".join(parts)  # how vLLM flattens text parts for string-content templates
    raise ConfigError("messages", f"message {index}: content must be a string or a list of text parts")


def _render_deepseek(messages: list[dict[str, Any]], add_generation_prompt: bool, bos: str) -> str:
    """DeepSeek-V3's layout (system text after BOS, then User/Assistant turns), for checkpoints with no template."""
    out = [bos, "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "developer"))]
    in_outputs = False  # consecutive tool results share one outputs block
    for m in messages:
        if in_outputs and m["role"] != "tool":
            out.append(_DS_OUTPUTS_END)
        in_outputs, was_in_outputs = m["role"] == "tool", in_outputs
        if m["role"] == "tool":
            out.append(("" if was_in_outputs else _DS_OUTPUTS_BEGIN) + _DS_OUTPUT_BEGIN + m["content"] + _DS_OUTPUT_END)
        elif m["role"] == "user":
            out.append(_DS_USER + m["content"])
        elif m["role"] == "assistant":
            out.append(_DS_ASSISTANT + m["content"] + DEEPSEEK_EOS)
    if in_outputs:
        out.append(_DS_OUTPUTS_END)
    if add_generation_prompt:
        out.append(_DS_ASSISTANT)
    return "".join(out)


def _render_plain(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"] if add_generation_prompt else lines)


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) as plain text."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Like transformers: no HTML escaping (jinja's own tojson escapes <, > and &), and json.dumps' options.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ConfigError("chat_template", f"the checkpoint's chat template does not compile: {e}") from None
