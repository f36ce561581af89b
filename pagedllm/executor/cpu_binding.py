"""Which cores each rank of each engine replica runs on: PAGEDLLM_CPU_OMP_THREADS_BIND, as vLLM's
VLLM_CPU_OMP_THREADS_BIND. "auto" (the default) splits this process's physical cores evenly in rank
order, a core's hyper-threads together; "0-7|8-15" names each rank's, as many for each; "all"
leaves them unbound. With data parallelism the ranks are every replica's, replica by replica."""

from __future__ import annotations

import math
import os

BIND_ENV = "PAGEDLLM_CPU_OMP_THREADS_BIND"


def parse_cpu_binding(spec: str | None, ranks: int, available: list[int]) -> list[list[int]] | None:
    """Each rank's cores, from PAGEDLLM_CPU_OMP_THREADS_BIND's value; None: leave them unbound."""
    spec = (spec or "auto").strip()
    if spec == "all":
        return None
    if spec == "auto":
        cores = physical_cores_of(available)
        if len(cores) < ranks:
            raise ValueError(
                f"{ranks} ranks (tensor-parallel size x data-parallel size) need a core each; this process may use "
                f"{len(cores)} ({BIND_ENV}=all runs them unbound)"
            )
        share = len(cores) // ranks
        return [sorted(cpu for core in cores[r * share : (r + 1) * share] for cpu in core) for r in range(ranks)]
    parts = spec.split("|")
    if len(parts) != ranks:
        raise ValueError(f"{BIND_ENV}={spec!r} names {len(parts)} core lists for {ranks} ranks")
    binding = [_cores(part, spec) for part in parts]
    # The ranks must sample alike: the same threads each, so that their reductions round alike.
    if len({len(cores) for cores in binding}) > 1:
        raise ValueError(f"{BIND_ENV}={spec!r}: give every rank as many cores")
    return binding


def physical_cores_of(cpus: list[int]) -> list[list[int]]:
    """The logical CPUs grouped by physical core (hyper-threads together), ordered by NUMA node,
    then socket, then core: an even split in this order gives ranks whole nodes where it can (a
    rank per node or socket, its memory local, as each rank loads its own weights once bound)."""
    cores: dict[tuple[int, int, int], list[int]] = {}
    for cpu in cpus:
        cores.setdefault(cpu_topology(cpu), []).append(cpu)
    return [sorted(cores[key]) for key in sorted(cores)]


def cpu_topology(cpu: int) -> tuple[int, int, int]:
    """(NUMA node, socket, core) of a logical CPU, from sysfs; (0, 0, cpu) where it says nothing."""
    base = f"/sys/devices/system/cpu/cpu{cpu}"
    node = next((int(name[4:]) for name in _listdir(base) if name.startswith("node") and name[4:].isdigit()), 0)
    try:
        package, core = (int(open(f"{base}/topology/{name}").read()) for name in ("physical_package_id", "core_id"))
    except (OSError, ValueError):
        package, core = 0, cpu
    return node, package, core


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _cores(part: str, spec: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    cores: list[int] = []
    try:
        for piece in part.split(","):
            first, _, last = piece.partition("-")
            cores.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"{BIND_ENV}={spec!r}: expected core lists like 0-7|8-15") from None
    if not cores:
        raise ValueError(f"{BIND_ENV}={spec!r}: a rank with no cores")
    return cores


def physical_cores() -> int:
    """The physical cores this process may run on."""
    return len(physical_cores_of(sorted(os.sched_getaffinity(0))))


def usable_cores() -> int:
    """The cores' worth of CPU time this process may use: its physical cores, fewer where a cgroup
    quota (a container's --cpus, a systemd CPUQuota) allows less (rounded up, at least 1)."""
    cores = physical_cores()
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs' worth of time a period the cgroups above this process allow (the tightest), or None."""
    quotas = []
    for line in _read(proc_cgroup).splitlines():
        _, controllers, path = line.split(":", 2)
        v2 = controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        base = (
            root
            if v2
            else next(
                (f"{root}/{name}" for name in ("cpu", "cpu,cpuacct", controllers) if os.path.isdir(f"{root}/{name}")),
                None,
            )
        )
        if base is None:
            continue
        # The process's own group and each one above it, to the mount's root (a container sees its
        # own group as "/").
        parts = [p for p in path.strip("/").split("/") if p]
        for depth in range(len(parts), -1, -1):
            group = os.path.join(base, *parts[:depth])
            quota = _v2_quota(group) if v2 else _v1_quota(group)
            if quota is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def _v2_quota(group: str) -> float | None:
    fields = _read(f"{group}/cpu.max").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return int(fields[0]) / int(fields[1])


def _v1_quota(group: str) -> float | None:
    quota, period = _read(f"{group}/cpu.cfs_quota_us").strip(), _read(f"{group}/cpu.cfs_period_us").strip()
    if not quota or not period or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, ValueError):
        return ""
