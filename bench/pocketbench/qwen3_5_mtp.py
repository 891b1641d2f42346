"""Qwen3.5's multi-token-prediction head side by side, in one run: PocketLLM cpp with MTP drafts and without,
beside llama.cpp's llama-server plain and with its own MTP speculation (``--spec-type draft-mtp``), on the same
Q4_K_M GGUF of the bench's realistic-size random model, greedy, the same prompt ids, 2 threads each.

    python -m pocketbench.qwen3_5_mtp --llama-server PATH [--k 2] [--runs 3] [--new-tokens 128]
        [--models-dir DIR] [--out results/]

The model: qwen3_5_models.py's Qwen3.5-0.8B configuration with random weights, and a head fitted to it (a random
head accepts nothing). The fit: the served file's own greedy continuations of the prompts below (PocketLLM cpp on
the Q4_K_M file, made first with a placeholder head, which changes none of the model's weights), then the head's
projection solved by ridge regression so that from the normed embedding of token i + 1 it points at the embedding
of token i + 2 (the output projection is the embedding, tied); the part that reads the model's hidden state is
zero. A random model's continuations have nothing to generalise: the head memorises these, and the bench runs the
prompts it was fitted on, so its acceptance is high by construction: what is measured is what drafting at that
acceptance costs and gains in each engine, with the same head. Its layer has random weights but for its two
output projections, zero, so it passes the projection on (and costs what a trained layer costs); its norms are
the identity. Converted with the head by llama.cpp's converter and quantized to Q4_K_M with it by llama-quantize's
library function (the model's tensors quantize to the same bytes as before), kept for the next run.

Reported: decode tok/s after the first token (llama-server's own ``predicted_per_second``, PocketLLM's from its
stream alike), median of --runs runs after a warm-up, all engines loaded and taking turns; the drafts' acceptance
per position (PocketLLM's stats; llama-server's drafted and accepted counts); whether PocketLLM's outputs with and
without drafts are the same tokens. Writes ``<date>-<machine>-qwen3_5-mtp.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from pocketbench.machine import write_report
from pocketbench.qwen3_5_models import MODELS, ModelSpec, convert, made_once, quantize, write_checkpoint
from pocketbench.speculative import LlamaServer, speed_table, take_turns
from pocketllm import LLM, SamplingParams

PROMPTS = ["The lighthouse stood at the end of the northern pier for more than a century.",
           "def total_price(items, tax_rate):\n    subtotal = 0\n",
           "List ten ideas for a science fair project.",
           "Once upon a time, a fox learned to paint."]
FIT_TOKENS = 160  # greedy tokens per prompt that the head is fitted to
RIDGE = 1e-2


def mtp_gguf_file(spec: ModelSpec, folder: Path, quant: str = "Q4_K_M") -> Path:
    """``folder/<name>-mtp-<quant>.gguf``, made unless it is there (see the module docstring)."""
    def make(tmp: Path, out: Path) -> None:
        hf = write_checkpoint(spec, tmp / "hf")
        write_head(hf, None)  # a placeholder: the model's weights, and so its outputs, do not depend on it
        unfitted = quantize(convert(hf, tmp / "bf16.gguf", mtp=True), tmp / "unfitted.gguf", quant)
        write_head(hf, greedy_continuations(unfitted))
        quantize(convert(hf, tmp / "bf16.gguf", mtp=True), out, quant)

    return made_once(folder / f"{spec.name}-mtp-{quant}.gguf", make)


def greedy_continuations(path: Path) -> list[list[int]]:
    """The prompts and the served model's greedy continuations of them (PocketLLM cpp, as the bench runs it)."""
    llm = LLM(str(path), backend="cpp", show_progress=False)
    try:
        prompts = [llm.tokenizer.encode(text) for text in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=FIT_TOKENS, ignore_eos=True)
        return [ids + out.outputs[0].token_ids for ids, out in zip(prompts, llm.generate(prompts, [params] * 4),
                                                                  strict=True)]
    finally:
        llm.shutdown()


def write_head(path: Path, sequences: list[list[int]] | None) -> None:
    """The head's ``mtp.*`` tensors as one more shard of the checkpoint at ``path``: its projection fitted to
    ``sequences`` (zero for None), its layer random but for its output projections, its norms the identity."""
    import torch
    from safetensors.torch import load_file, save_file

    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    weights = index["weight_map"]
    embedding = load_file(path / weights["model.embed_tokens.weight"])["model.embed_tokens.weight"].float()
    hidden = embedding.shape[1]
    fc = torch.zeros(hidden, 2 * hidden)
    if sequences is not None:
        # Ridge regression from the normed embedding of token i + 1 to that of token i + 2 (the tied head's row).
        x = torch.cat([_rms(embedding[torch.tensor(ids[1:-1])]) for ids in sequences]).double()
        y = torch.cat([_rms(embedding[torch.tensor(ids[2:])]) for ids in sequences]).double()
        fc[:, :hidden] = torch.linalg.solve(x.T @ x + RIDGE * torch.eye(hidden, dtype=torch.float64), x.T @ y).T
    head = {"mtp.fc.weight": fc.to(torch.bfloat16)}
    full = f"model.layers.{MODELS['dense'].layer_types().index('full_attention')}."
    for name, file in sorted(weights.items()):
        if name.startswith(full):
            part = name.removeprefix(full)
            t = load_file(path / file)[name]
            zero = part.endswith(("norm.weight", "o_proj.weight", "down_proj.weight"))
            head["mtp.layers.0." + part] = (torch.zeros_like(t) if zero else t).contiguous()
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # zero-centred: the identity
        head[f"mtp.{norm}.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
    save_file(head, path / "model-mtp.safetensors", metadata={"format": "pt"})
    weights |= dict.fromkeys(head, "model-mtp.safetensors")
    index_file.write_text(json.dumps(index))


def _rms(x: Any) -> Any:
    return x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()


ENGINES = ("pocketllm-cpp", "pocketllm-cpp + mtp", "llama.cpp", "llama.cpp + mtp")


@contextmanager
def engine(kind: str, path: Path, args: argparse.Namespace) -> Iterator[Any]:
    if kind.startswith("llama.cpp"):
        spec = ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(args.k)] if "mtp" in kind else []
        server = LlamaServer(args.llama_server, path, args.threads, spec)
        try:
            yield server
        finally:
            server.close()
        return
    spec = {"speculative_method": "mtp", "num_speculative_tokens": args.k} if "mtp" in kind else {}
    llm = LLM(str(path), backend="cpp", backend_options={"num_threads": args.threads}, show_progress=False, **spec)
    try:
        yield llm
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=2, help="tokens drafted per step, both engines")
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "pocketbench-qwen3_5")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    args = parser.parse_args()
    spec = MODELS["dense"]
    path = mtp_gguf_file(spec, args.models_dir)
    notes: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    with ExitStack() as stack:
        engines = {kind: stack.enter_context(engine(kind, path, args)) for kind in ENGINES}
        tokenizer = engines["pocketllm-cpp"].tokenizer
        prompts = {f"prompt {i}": tokenizer.encode(text) for i, text in enumerate(PROMPTS)}
        speeds = take_turns(engines, prompts, args.new_tokens, args.runs, notes, outputs)
        stats = engines["pocketllm-cpp + mtp"].stats()
    same = outputs["pocketllm-cpp"] == outputs["pocketllm-cpp + mtp"]
    medians = {key: statistics.median(values) for key, values in speeds.items()}
    drafts = max(stats.num_spec_drafts, 1)
    per_position = [round(a / drafts, 3) for a in stats.spec_accepted_per_position]
    lines = [f"# Qwen3.5 MTP, {spec.name} (random, fitted head) Q4_K_M, {args.threads} threads, greedy, "
             f"{args.new_tokens} new tokens, k = {args.k}", "",
             f"Decode tok/s after the first token, median of {args.runs} runs. PocketLLM's outputs with and without "
             f"drafts {'are' if same else 'are NOT'} the same tokens. PocketLLM's drafts: "
             f"{stats.num_spec_accepted_tokens} of {stats.num_spec_draft_tokens} drafted tokens accepted; accepted "
             f"per position, per draft: {per_position}.", "",
             *speed_table(ENGINES, list(prompts), medians, [(1, 0), (1, 2), (1, 3)])]
    lines += ["", "llama-server's drafts (drafted, accepted) per prompt: " + json.dumps(notes)]
    write_report(args.out, "qwen3_5-mtp", "\n".join(lines) + "\n",
                 {"speeds": {f"{k} | {label}": v for (k, label), v in speeds.items()}, "notes": notes, "same": same,
                  "accepted_per_position": stats.spec_accepted_per_position,
                  "drafts": [stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens],
                  "args": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    main()
