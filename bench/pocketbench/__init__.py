"""Side-by-side benchmarks of PocketLLM backends against llama.cpp and transformers.

Run as ``pocketllm bench`` or ``nox -s bench``. The parent process (this package, without torch) builds the
prompts, drives one worker process per engine over JSON lines, interleaves their runs and writes the report.
"""
