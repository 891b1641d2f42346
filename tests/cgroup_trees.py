"""Fake cgroup trees: the cases both backends' CPU-quota readers (C++ and pocketllm_torch.cpus) are tested on."""

from __future__ import annotations

from pathlib import Path


def cgroup_tree(root: Path, cgroup: str, mounts: list[str], files: dict[str, str]) -> Path:
    """A directory that mimics /proc/self/{cgroup,mountinfo} and the cgroup files below it."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text("".join(line + "\n" for line in mounts))
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate"
V1_MOUNT = ("35 25 0:30 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid master:11 - cgroup cgroup "
            "rw,cpu,cpuacct")

QUOTA_CASES = [
    # v2: the smallest limit up the hierarchy (a parent's applies to its children)
    ("0::/user.slice/app\n", [V2_MOUNT], {"sys/fs/cgroup/user.slice/app/cpu.max": "max 100000",
                                          "sys/fs/cgroup/user.slice/cpu.max": "150000 100000"}, 1.5),
    # v2 in a container: its own cgroup at the mount's top
    ("0::/\n", [V2_MOUNT], {"sys/fs/cgroup/cpu.max": "200000 100000"}, 2.0),
    ("0::/\n", [V2_MOUNT], {"sys/fs/cgroup/cpu.max": "max 100000"}, 0.0),
    # v1 in a container: the host's path for the cgroup the mount shows at its top
    ("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n", [V1_MOUNT],
     {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "50000", "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"},
     0.5),
    ("4:cpu,cpuacct:/\n", [V1_MOUNT.replace("/docker/abc", "/")],
     {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1", "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"},
     0.0),
    ("", [], {}, 0.0),  # no cgroups at all
]
"""(cgroup, mounts, files, expected CPUs) of each tree."""
