"""NUMA topology from /sys/devices/system/node and pinning a process to one node.

Placement works by first touch: pin the process's threads to a node's CPUs, then let
the pool prefault its arenas from that thread, so Linux puts the pages on that node.
On a one-node machine pinning only restricts CPUs; memory placement is trivially local.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: list[int]
    memory_total_bytes: int | None
    distances: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class NumaTopology:
    nodes: list[NumaNode]
    source: str

    @property
    def single_node(self) -> bool:
        return len(self.nodes) <= 1

    def node(self, node_id: int) -> NumaNode:
        for node in self.nodes:
            if node.id == node_id:
                return node
        known = ", ".join(str(n.id) for n in self.nodes) or "none"
        raise ValueError(f"numa_node={node_id}: no such node (this machine has: {known})")

    def describe(self) -> str:
        lines = []
        for n in self.nodes:
            mem = f"{n.memory_total_bytes / 2**30:.1f} GiB" if n.memory_total_bytes else "memory unknown"
            lines.append(f"node{n.id}: cpus {_cpulist(n.cpus)}, {mem}, distances {n.distances or '-'}")
        if self.single_node:
            lines.append("single NUMA node: all memory is local; pinning only restricts CPUs")
        return "\n".join(lines)


def _cpulist(cpus: list[int]) -> str:
    if not cpus:
        return "-"
    ranges, start, prev = [], cpus[0], cpus[0]
    for c in cpus[1:] + [None]:  # type: ignore[list-item]
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
        if c is not None:
            start = prev = c
    return ",".join(ranges)


def _meminfo_total(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if "MemTotal:" in line:
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError):
        pass
    return None


def read_topology(root: Path = NODE_ROOT) -> NumaTopology:
    """Nodes, their CPUs, memory and distances; one pseudo-node of all CPUs without sysfs."""
    nodes = []
    for path in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpulist((path / "cpulist").read_text())
        except OSError:
            cpus = []
        try:
            distances = [int(v) for v in (path / "distance").read_text().split()]
        except (OSError, ValueError):
            distances = []
        nodes.append(NumaNode(int(path.name[4:]), cpus, _meminfo_total(path / "meminfo"), distances))
    if nodes:
        return NumaTopology(nodes, str(root))
    return NumaTopology([NumaNode(0, sorted(os.sched_getaffinity(0)), None)], "no sysfs nodes: one assumed")


def pin_process_to_node(node_id: int, topology: NumaTopology | None = None) -> list[int]:
    """Restrict every thread of this process (and threads it starts later) to the node's CPUs.

    Returns the CPUs used. Raises ValueError naming the node if it does not exist or none
    of its CPUs is allowed to this process."""
    topology = topology or read_topology()
    node = topology.node(node_id)
    allowed = set(os.sched_getaffinity(0))
    cpus = sorted(set(node.cpus) & allowed)
    if not cpus:
        raise ValueError(f"numa_node={node_id}: none of its CPUs {_cpulist(node.cpus)} is allowed "
                         f"to this process ({_cpulist(sorted(allowed))})")
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, PermissionError):
            continue  # thread exited meanwhile
    return cpus
