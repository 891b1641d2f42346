"""Text <-> token ids for a checkpoint, with the same ids transformers produces."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import processors

from pocketllm.checkpoint.configs import token_ids
from pocketllm.checkpoint.gguf_tokenizer import tokenizer_from_gguf
from pocketllm.checkpoint.jsonfile import read_json_object
from pocketllm.errors import CheckpointError

if TYPE_CHECKING:
    from pocketllm.checkpoint import Checkpoint


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR = {char: byte for byte, char in _bytes_to_unicode().items()}


def _uses_byte_level(decoder: object) -> bool:
    if isinstance(decoder, tokenizers.decoders.ByteLevel):
        return True
    return isinstance(decoder, tokenizers.decoders.Sequence) and '"ByteLevel"' in str(decoder.__getstate__())


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what generation needs: BOS/EOS ids and the chat template.

    Whether ``encode`` adds BOS/EOS is decided by the backend's post-processor,
    set up at load time the way transformers sets it up.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.special_token_ids = frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._byte_level = _uses_byte_level(backend.decoder)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token decodes to: the longest vocabulary entry (byte-level and
        SentencePiece spellings never decode to more characters than they are spelled with)."""
        return max((len(piece) for piece in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which may be part of a UTF-8 character (OpenAI's logprob ``bytes``).

        Byte-level BPE spells each byte as one printable character; SentencePiece spells byte fallbacks
        ``<0xNN>``. Anything else is its decoded text."""
        piece = self.backend.id_to_token(token_id)
        if piece is not None and token_id not in self.special_token_ids:
            if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Raw vocabulary strings (byte-level or ``▁`` spelling), for incremental detokenization.

        Ids beyond the vocabulary (models often pad their embedding) map to "".
        """
        return [self.backend.id_to_token(i) or "" for i in ids]

    id_to_token = convert_ids_to_tokens

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint) -> Tokenizer:
        if checkpoint.format == "gguf":
            return cls._from_gguf(checkpoint)
        return cls._from_files(checkpoint.tokenizer_files(), checkpoint)

    @classmethod
    def _from_gguf(cls, checkpoint: Checkpoint) -> Tokenizer:
        meta = checkpoint.gguf_metadata
        backend = tokenizer_from_gguf(meta, str(checkpoint.path))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        # transformers' default: sentencepiece files add BOS unless they say otherwise, byte-level ones do not.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
        _set_post_processor(backend, bos if add_bos else None, eos if add_eos else None)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=token_ids(eos, checkpoint.config.eos_token_ids),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def _from_files(cls, files: Mapping[str, Path], checkpoint: Checkpoint) -> Tokenizer:
        if "tokenizer.json" not in files:
            raise CheckpointError(f"{checkpoint.path}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(files["tokenizer.json"]))
        except Exception as e:  # tokenizers raises plain Exception for malformed files
            raise CheckpointError(f"{files['tokenizer.json']}: cannot load tokenizer: {e}") from None
        config = read_json_object(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
        bos = _token_id(backend, config.get("bos_token"))
        eos = _token_id(backend, config.get("eos_token"))
        # tokenizer.json's post-processor alone decides what encode() adds: transformers 5 ignores
        # tokenizer_config's add_bos_token/add_eos_token whenever there is a tokenizer.json.
        return cls(
            backend,
            bos_token_id=bos if bos is not None else checkpoint.config.bos_token_id,
            eos_token_ids=token_ids(eos, checkpoint.config.eos_token_ids),
            chat_template=_chat_template(files, config),
        )


def _set_post_processor(backend: tokenizers.Tokenizer, bos: int | None, eos: int | None) -> None:
    """Add BOS before and/or EOS after every encoded text (or nothing, when both are None)."""
    bos_tok = backend.id_to_token(bos) if bos is not None else None
    eos_tok = backend.id_to_token(eos) if eos is not None else None

    def wrap(sequence: str, type_id: int) -> str:
        return " ".join(f"{piece}:{type_id}" for piece in (bos_tok, sequence, eos_tok) if piece is not None)

    special = {tok: i for tok, i in ((bos_tok, bos), (eos_tok, eos)) if tok is not None}
    backend.post_processor = processors.TemplateProcessing(
        single=wrap("$A", 0), pair=f"{wrap('$A', 0)} {wrap('$B', 1)}", special_tokens=list(special.items())
    )


def _chat_template(files: Mapping[str, Path], config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config.json's (transformers' order)."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].read_text(encoding="utf-8")
    template = config.get("chat_template")
    if "chat_template.json" in files:
        template = read_json_object(files["chat_template.json"]).get("chat_template") or template
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_id(backend: tokenizers.Tokenizer, token: object) -> int | None:
    if isinstance(token, dict):  # serialized AddedToken
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None
