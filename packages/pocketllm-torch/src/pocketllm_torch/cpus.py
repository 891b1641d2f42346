"""How many CPUs this process may use, which is the default number of torch's intra-op threads.

torch's own default is the machine's physical cores in the affinity mask at start-up: it ignores a container's
CPU quota (a 2-CPU quota on a 64-core host gets 64 threads, each waiting on the others while the quota throttles
them) and a mask narrowed after torch loaded. The quota is read as the cpp backend reads it (cgroup v2 ``cpu.max``
or v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, the smallest up the hierarchy).
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def available_cpus(root: Path = Path("/")) -> int:
    """CPUs in this process's affinity mask, at most its cgroups' CPU quota rounded up; at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)


def cgroup_cpu_quota(root: Path = Path("/")) -> float:
    """The CPU quota of the cgroups this process is in, in CPUs (the smallest of every hierarchy and level); 0 for
    none. ``root`` stands for ``/`` (tests give a directory that mimics /proc and /sys)."""
    paths = _cgroup_paths(_read(root / "proc/self/cgroup"))
    quotas = []
    for line in _read(root / "proc/self/mountinfo").splitlines():
        fields = line.split(" ")
        if "-" not in fields or len(fields) < 5:
            continue
        dash = fields.index("-")
        if len(fields) - dash < 4:
            continue
        kind, options = fields[dash + 1], fields[dash + 3].split(",")
        v2 = kind == "cgroup2"
        key = "v2" if v2 else "v1" if kind == "cgroup" and "cpu" in options else None
        if key in paths:
            quotas.append(_hierarchy_quota(root / fields[4].lstrip("/"), fields[3], paths[key], v2))
    return min((q for q in quotas if q > 0), default=0.0)


def _cgroup_paths(text: str) -> dict[str, str]:
    """This process's cgroup in the v2 hierarchy ("0::/path") and in v1's cpu controller ("4:cpu,cpuacct:/path")."""
    paths = {}
    for line in text.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and not controllers:
            paths["v2"] = path
        elif "cpu" in controllers.split(","):
            paths["v1"] = path
    return paths


def _hierarchy_quota(mount: Path, mount_root: str, path: str, v2: bool) -> float:
    """The smallest quota from the cgroup at ``path`` up to the mount's top, which shows the cgroup ``mount_root``
    (in a container, usually its own: a path outside it is not visible, and the mount's top is the nearest)."""
    if mount_root != "/":
        path = path[len(mount_root):] if path.startswith(mount_root) else ""
    parts = [p for p in path.split("/") if p]
    quotas = [_quota_at(mount.joinpath(*parts[:depth]), v2) for depth in range(len(parts), -1, -1)]
    return min((q for q in quotas if q > 0), default=0.0)


def _quota_at(directory: Path, v2: bool) -> float:
    """The CPUs one cgroup's own files allow, 0 for no limit ("max", -1, missing files)."""
    if v2:
        fields = _read(directory / "cpu.max").split()
        quota, period = fields if len(fields) == 2 else ("", "")
    else:
        quota, period = _read(directory / "cpu.cfs_quota_us").strip(), _read(directory / "cpu.cfs_period_us").strip()
    q, p = _positive(quota), _positive(period)
    return q / p if q and p else 0.0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if value > 0 and math.isfinite(value) else 0.0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
