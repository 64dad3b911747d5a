"""dspark's benchmarks in layers: `micro` (operators), `model` (one model on a running Triton
server), `system` (several models with a traffic mix); results in one versioned JSON schema,
compared with `compare`, plotted with `plots`, written into the docs by `docs`. The CLI
(dspark/cli/bench/) is a thin layer over these modules."""
