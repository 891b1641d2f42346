"""What machine the figures come from: a short name for file names and the facts kept with the results."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

SIMD_LEVELS = ("avx512f", "avx2")  # the widest x86 vector extension tells the figures apart most


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty elsewhere)."""
    path = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in (path.read_text() if path.exists() else "").splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def simd_level(info: dict[str, str]) -> str | None:
    flags = set(info.get("flags", "").split())
    return next((level.removesuffix("f") for level in SIMD_LEVELS if level in flags), None)


def machine_name() -> str:
    """File-name-safe, e.g. ``amd-epyc-avx2-2c``: one model name covers CPUs of different generations."""
    info = _cpuinfo()
    model = info.get("model name", platform.machine())
    simd = simd_level(info)
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "unknown"
    return "-".join(filter(None, [slug, simd, f"{os.cpu_count()}c"]))


def describe() -> dict[str, Any]:
    import psutil

    info = _cpuinfo()
    return {"cpu": info.get("model name", platform.processor()), "cpu_family": info.get("cpu family"),
            "cpu_model": info.get("model"), "simd": simd_level(info),
            "logical_cpus": psutil.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "kernel": platform.release()}


def write_report(out: Path, workload: str, report: str, figures: dict[str, Any]) -> None:
    """Print a workload's table and write it beside its figures: ``<date>-<machine>-<workload>.{md,json}``."""
    import datetime
    import json

    print(report)
    stem = out / f"{datetime.date.today().isoformat()}-{machine_name()}-{workload}"
    stem.with_suffix(".md").write_text(report)
    stem.with_suffix(".json").write_text(json.dumps({"machine": describe()} | figures, indent=1) + "\n")
