"""`dspark trace`: bpftrace programs over dspark's USDT probes and the kernel's sched tracepoints,
attached to a running server, and the report made from their output."""
