"""Rebuild a ``tokenizers.Tokenizer`` from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json, only llama.cpp's keys. The pipeline built
here is the one transformers builds for the same file (integrations/gguf/
gguf_tokenizer_mapping.py), so token ids match ``AutoTokenizer`` with
``gguf_file=``. Where llama.cpp's own pre-tokenizer differs (SmolLM2's
"smollm" splits digits one by one there, not in transformers), transformers wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from pocketllm.errors import CheckpointError

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types (gguf.TokenType)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex, as in transformers; any other name gets GPT-2's byte-level regex.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# Architectures whose sentencepiece files transformers rebuilds differently; not reproduced here.
_UNSUPPORTED_SENTENCEPIECE = frozenset({"gemma", "gemma2", "gemma3", "phi3"})


def tokenizer_from_gguf(meta: Mapping[str, Any], source: str) -> Tokenizer:
    """The tokenizer described by ``tokenizer.ggml.*``, with control tokens added as special tokens.

    No post-processor is set: adding BOS/EOS is the caller's decision.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{source}: GGUF metadata has no tokenizer.ggml.tokens")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in meta and len(meta[key]) != len(tokens):
            raise CheckpointError(f"{source}: {key} has {len(meta[key])} entries for {len(tokens)} tokens")
    if kind not in ("gpt2", "llama") or (kind == "llama" and meta.get("general.architecture") in
                                         _UNSUPPORTED_SENTENCEPIECE):
        raise CheckpointError(
            f"{source}: unsupported GGUF tokenizer model {kind!r} for architecture {meta.get('general.architecture')!r}"
        )
    try:
        tokenizer = _byte_level(meta, tokens) if kind == "gpt2" else _sentencepiece(meta, tokens)
        _add_special_tokens(tokenizer, meta, tokens, byte_level=kind == "gpt2")
    except ValueError as e:  # what the metadata holds, named by _merges
        raise CheckpointError(f"{source}: {e}") from None
    except Exception as e:  # the tokenizers library reports a bad vocabulary or merge as a bare Exception
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens or tokenizer.ggml.merges: the tokenizer cannot be "
                              f"built: {e}") from None
    return tokenizer


def _merges(meta: Mapping[str, Any], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as pairs, split as llama.cpp splits them (at the first space after the first
    character); a merge that does not split, or names a piece outside the vocabulary, is a ValueError naming it."""
    merges = meta["tokenizer.ggml.merges"]
    if not isinstance(merges, list):
        raise ValueError(f"tokenizer.ggml.merges must be an array of strings, got {type(merges).__name__}")
    pairs = []
    for index, merge in enumerate(merges):
        cut = merge.find(" ", 1) if isinstance(merge, str) else -1
        pair = (merge[:cut], merge[cut + 1:]) if cut > 0 else None
        if pair is None or pair[0] not in vocab or pair[1] not in vocab:
            raise ValueError(f"tokenizer.ggml.merges[{index}] = {merge!r} is not two tokens of the vocabulary "
                             "separated by a space")
        pairs.append(pair)
    return pairs


def _byte_level(meta: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    alphabet = _byte_alphabet()
    # Tokens written with characters outside the byte alphabet are respelled, as transformers does.
    vocab = {tok if set(tok) <= alphabet else _respell(tok): i for i, tok in enumerate(tokens)}
    merges = _merges(meta, vocab) if "tokenizer.ggml.merges" in meta else []
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    """SentencePiece BPE with byte fallback, like transformers' LlamaTokenizer (legacy=False)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = _merges(meta, vocab)
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a scored vocabulary (transformers' generate_merges): every split of a
    token into two known pieces is a merge, best-scored token first."""
    merges: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))]
        known = sorted((p for p in pairs if p[0] in vocab and p[1] in vocab), key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((left, right, score) for left, right in known)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tokenizer: Tokenizer, meta: Mapping[str, Any], tokens: list[str], *, byte_level: bool) -> None:
    # Files without token types get no control tokens beyond BOS/EOS/UNK/PAD below.
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    alphabet = _byte_alphabet()
    # In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp mislabel;
    # adding it would grow the vocabulary past the model's, so it is skipped (as transformers does).
    special = [
        tok
        for tok, kind in zip(tokens, types, strict=True)
        if kind == _CONTROL and (not byte_level or set(tok) <= alphabet)
    ]
    # BOS/EOS/UNK/PAD are special even when the file does not mark them as control tokens.
    for key in ("bos", "eos", "unknown", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens) and tokens[token_id] not in special:
            special.append(tokens[token_id])
    tokenizer.add_special_tokens([AddedToken(tok, normalized=False, special=True) for tok in special])
    vocab = tokenizer.get_vocab()
    user_defined = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, types, strict=True)
        if kind == _USER_DEFINED and tok in vocab
    ]
    tokenizer.add_tokens(user_defined)


@lru_cache(maxsize=1)
def _byte_alphabet() -> frozenset[str]:
    """The 256 printable characters GPT-2's byte-level BPE spells bytes with."""
    return frozenset(pre_tokenizers.ByteLevel.alphabet())


def _respell(token: str) -> str:
    """Spell a token's UTF-8 bytes in the byte-level alphabet."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(token)[0][0]
