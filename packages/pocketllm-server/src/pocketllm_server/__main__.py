from __future__ import annotations

from pocketllm_server.cli import main

raise SystemExit(main())
