"""PocketLLM's PyTorch backend: paged KV cache, continuous batching and on-device sampling for Llama-family models.

Importing this package is cheap: torch is only imported when an engine is created (through ``openmp.import_torch``,
which makes its OpenMP threads sleep rather than spin while they wait).
"""
