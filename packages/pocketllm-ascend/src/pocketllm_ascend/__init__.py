"""PocketLLM's Ascend NPU backend: the torch backend's engine (scheduler, paged KV cache, models, sampler, prefix
caching and state snapshots) on ``npu`` devices, with HCCL for tensor parallelism and torch_npu's fused operators.

Importing this package is cheap: torch and torch_npu are imported when an engine is created.
"""
