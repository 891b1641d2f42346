"""Everything one bench run measured, as written to the JSON file."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pocketbench.fidelity import FidelityCase
from pocketbench.stats import Summary
from pocketbench.workloads import Figure


@dataclass
class BenchResults:
    meta: dict[str, Any]
    engines: dict[str, dict[str, Any]]  # label -> the worker's info, plus peak_rss_mb
    ours: list[str]  # labels of the PocketLLM engines
    peers: list[str]
    serving: list[tuple[str, str]] = field(default_factory=list)  # (library, HTTP) labels of the serve workload
    baselines: list[tuple[str, str]] = field(default_factory=list)  # (ours, the --baseline version's) labels
    figures: list[Figure] = field(default_factory=list)
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # figure key -> label -> runs
    raw: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)  # measurement -> label -> replies
    fidelity: list[FidelityCase] = field(default_factory=list)

    def record(self, measurement: str, label: str, reply: dict[str, Any], values: dict[str, float]) -> None:
        # Token ids of timed runs are checked for their count only; keep the file small.
        self.raw.setdefault(measurement, {}).setdefault(label, []).append(
            {k: v for k, v in reply.items() if k != "token_ids"})
        for key, value in values.items():
            self.values.setdefault(key, {}).setdefault(label, []).append(value)

    def summary(self, figure: str, label: str) -> Summary | None:
        runs = self.values.get(figure, {}).get(label)
        return Summary.of(runs) if runs else None

    def ratio(self, figure: str, label: str, reference: str) -> float | None:
        """Median of ``label`` / median of ``reference``; None when either has no runs."""
        a, b = self.summary(figure, label), self.summary(figure, reference)
        return None if a is None or b is None else a.median / b.median

    def serving_ratios(self) -> dict[str, dict[str, float]]:
        """HTTP / library medians of every serve figure, keyed "HTTP label / library label"."""
        return {f"{http} / {library}": {f.key: r for f in self.figures
                                        if (r := self.ratio(f.key, http, library)) is not None}
                for library, http in self.serving}

    def write_json(self, path: Path) -> None:
        data = dataclasses.asdict(self)
        data["summaries"] = {f.key: {label: dataclasses.asdict(s) for label in self.engines
                                     if (s := self.summary(f.key, label)) is not None} for f in self.figures}
        data["serving_ratios"] = self.serving_ratios()
        path.write_text(json.dumps(data, indent=1) + "\n")
