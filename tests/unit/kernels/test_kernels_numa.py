"""NUMA topology from sysfs (a fake two-node tree and this machine) and pinning."""
import os

import pytest

from dspark.kernels.numa import parse_cpulist, pin_process_to_node, read_topology


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []


def _fake_node(root, node, cpulist, mem_kb, distance):
    d = root / f"node{node}"
    d.mkdir(parents=True)
    (d / "cpulist").write_text(cpulist + "\n")
    (d / "meminfo").write_text(f"Node {node} MemTotal:       {mem_kb} kB\nNode {node} MemFree: 1 kB\n")
    (d / "distance").write_text(distance + "\n")


def test_reads_a_two_node_topology(tmp_path):
    _fake_node(tmp_path, 1, "4-7", 2048, "21 10")
    _fake_node(tmp_path, 0, "0-3", 1024, "10 21")
    (tmp_path / "online").write_text("0-1\n")
    topo = read_topology(tmp_path)
    assert [n.id for n in topo.nodes] == [0, 1]
    assert topo.nodes[1].cpus == [4, 5, 6, 7]
    assert topo.nodes[0].memory_total_bytes == 1024 * 1024
    assert topo.nodes[1].distances == [21, 10]
    assert not topo.single_node
    assert "node1: cpus 4-7" in topo.describe()


def test_this_machine_has_nodes_covering_our_cpus():
    topo = read_topology()
    assert topo.nodes
    covered = {cpu for node in topo.nodes for cpu in node.cpus}
    assert set(os.sched_getaffinity(0)) <= covered
    if topo.single_node:
        assert "single NUMA node" in topo.describe()


def test_pinning_restricts_every_thread_to_the_node():
    topo = read_topology()
    before = os.sched_getaffinity(0)
    try:
        cpus = pin_process_to_node(topo.nodes[0].id, topo)
        assert set(cpus) <= set(topo.nodes[0].cpus)
        assert os.sched_getaffinity(0) == set(cpus)
    finally:
        os.sched_setaffinity(0, before)


def test_unknown_node_is_named():
    with pytest.raises(ValueError, match="numa_node=99: no such node"):
        pin_process_to_node(99)
