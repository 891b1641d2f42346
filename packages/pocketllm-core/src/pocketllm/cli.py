"""The pocketllm command: list backends, generate once, chat, serve, or benchmark."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from pocketllm.cli_args import add_engine_args, engine_args_from
from pocketllm.errors import PocketLLMError
from pocketllm.sampling_params import SamplingParams


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the harness parses its own arguments
        from pocketllm.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["serve"]:  # `vllm serve` habits: the server's own command line
        return _serve(argv[1:])
    parser = argparse.ArgumentParser(prog="pocketllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list installed backends, their availability and capabilities")
    gen = sub.add_parser("generate", help="complete one prompt and print the text as it streams")
    gen.add_argument("prompt")
    chat = sub.add_parser("chat", help="chat interactively (empty line or Ctrl-D quits)")
    chat.add_argument("--system", default=None, help="system prompt")
    sub.add_parser("serve", add_help=False, help="run the OpenAI-compatible server (pocketllm-server's options; "
                                                  "needs pocketllm-server installed)")
    sub.add_parser("bench", add_help=False, help="benchmark against llama.cpp and transformers, from a checkout "
                                                  "(`pocketllm bench --help`)")
    for p in (gen, chat):
        sampling = p.add_argument_group("sampling", "what a flag leaves out comes from the model's recommended "
                                        "settings (generation_config.json or GGUF metadata), else from the "
                                        "defaults shown, which give coherent answers with the default model")
        sampling.add_argument("--max-tokens", type=int, default=None, metavar="N",
                              help=f"most tokens to generate (default: {CLI_SAMPLING['max_tokens']})")
        sampling.add_argument("--temperature", type=float, default=None,
                              help=f"0 is greedy (default: {CLI_SAMPLING['temperature']})")
        sampling.add_argument("--top-p", type=float, default=None, help=f"(default: {CLI_SAMPLING['top_p']})")
        sampling.add_argument("--sampling-seed", type=int, default=None, metavar="N",
                              help="seed of this generation's random draws, for repeatable output (default: none: "
                                   "drawn from the engine's --seed stream)")
        sampling.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                              help="none: ignore the model's recommended settings (default: %(default)s)")
        add_engine_args(p)
    ns = parser.parse_args(argv)
    try:
        if ns.command == "backends":
            return _backends()
        from pocketllm.llm import LLM

        llm = LLM(engine_args=engine_args_from(ns))
        try:
            params = _sampling(ns, llm.sampling_defaults if ns.generation_config == "auto" else {})
            return _generate(llm, ns.prompt, params) if ns.command == "generate" else _chat(llm, ns.system, params)
        finally:
            llm.shutdown()
    except PocketLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


SERVER_SCRIPT = "pocketllm-server"  # the server distribution's console script


def _serve(argv: list[str]) -> int:
    """The server's own command line, reached through its console script's entry point: the core knows the server
    by that name only, and never imports it."""
    script = next(iter(entry_points(group="console_scripts", name=SERVER_SCRIPT)), None)
    if script is None:
        print("error: `pocketllm serve` needs the server: pip install pocketllm-server", file=sys.stderr)
        return 2
    try:
        server_main = script.load()
    except ImportError as e:
        print(f"error: `pocketllm serve`: the installed pocketllm-server does not load ({e}); reinstall it: "
              "pip install pocketllm-server", file=sys.stderr)
        return 2
    return server_main(argv, prog="pocketllm serve")


# SmolLM2's model card recommends these; sampled at 0.7 or 1.0 the 135M default model rambles.
CLI_SAMPLING = {"max_tokens": 256, "temperature": 0.2, "top_p": 0.9}


def _sampling(ns: argparse.Namespace, model_defaults: dict[str, object]) -> SamplingParams:
    """Flags, else the model's recommendation, else CLI_SAMPLING."""
    flags = {"max_tokens": ns.max_tokens, "temperature": ns.temperature, "top_p": ns.top_p, "seed": ns.sampling_seed}
    values = {**CLI_SAMPLING, **model_defaults, **{k: v for k, v in flags.items() if v is not None}}
    return SamplingParams(**values)  # type: ignore[arg-type]


def _backends() -> int:
    from pocketllm.backend_options import describe
    from pocketllm.plugins import BackendRegistry

    registry = BackendRegistry()
    entries = registry.entries()  # a backend whose hooks raise here is listed with the failures below
    for entry in entries:
        caps = entry.capabilities
        state = f"score {entry.score}" if entry.score > 0 else f"unavailable here: {entry.unavailable or 'probe 0'}"
        print(f"{entry.name}  ({entry.distribution} {entry.version}, {state})")
        print(f"    architectures: {', '.join(caps.architectures)}; devices: {', '.join(caps.devices)}; "
              f"dtypes: {', '.join(caps.dtypes)}")
        print(f"    max batch: {caps.max_num_seqs or 'any'}; prefix caching: {caps.prefix_caching}; "
              f"tensor parallel: {caps.tensor_parallel}; speculative: {', '.join(caps.speculative_methods) or '-'}")
        print(f"    sampling: greedy, {', '.join(caps.sampling_options) or '-'}")
        print(f"    quantization formats: {', '.join(caps.quantization_formats) or '-'}")
        options = describe(caps.backend_options)
        print(f"    backend options (--backend-options JSON keys):{'' if options else ' none'}")
        for option in options:
            print(f"      {option.name} ({option.expects}; default {option.default}){': ' if option.help else ''}"
                  f"{option.help}")
    for failure in registry.failures:
        state = "BROKEN" if failure.broken else "FAILED TO LOAD"
        print(f"{failure.entry_point}  ({failure.distribution} {failure.version}, {state}: {failure.error})")
    if not entries and not registry.failures:
        print("no backends installed; try `pip install pocketllm-torch`")
    return 0


def _generate(llm: object, prompt: str, params: SamplingParams) -> int:
    for event in llm.generate_stream(prompt, params):  # type: ignore[attr-defined]
        print(event.text, end="", flush=True)
    print()
    return 0


def _chat(llm: object, system: str | None, params: SamplingParams) -> int:
    messages = [{"role": "system", "content": system}] if system else []
    if sys.stdin.isatty():
        print(f"chatting with {llm.args.model} on backend {llm.backend_name} "  # type: ignore[attr-defined]
              f"(temperature {params.temperature}, top_p {params.top_p}, at most {params.max_tokens} tokens a "
              "reply); an empty line or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = ""
        for event in llm.chat_stream(messages, params):  # type: ignore[attr-defined]
            reply += event.text
            print(event.text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
