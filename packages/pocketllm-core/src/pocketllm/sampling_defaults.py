"""A checkpoint's recommended sampling settings, kept where SamplingParams accepts them.

This is not in the checkpoint package, which reads files: checking a setting takes SamplingParams, whose
structured outputs reach the tokenizer, which reads checkpoints (an import cycle when the check lived there).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pocketllm.errors import ConfigError
from pocketllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pocketllm.checkpoint import Checkpoint

log = logging.getLogger(__name__)


def recommended_defaults(checkpoint: Checkpoint) -> dict[str, Any]:
    """The settings the checkpoint recommends that SamplingParams accepts, as its fields; others are logged and
    left out, never fatal."""
    fields: dict[str, Any] = {}
    for setting in checkpoint.recommended_sampling():
        try:
            SamplingParams(**{"max_tokens": None, setting.field: setting.value})
        except (ConfigError, TypeError) as e:
            log.warning("%s: ignoring the recommended %s=%r: %s", checkpoint.path, setting.key, setting.value, e)
            continue
        fields[setting.field] = setting.value
    return fields
