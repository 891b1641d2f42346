"""``python -m pocketbench`` (from ``bench/``), which is what ``pocketllm bench`` runs."""

from pocketbench.cli import main

raise SystemExit(main())
