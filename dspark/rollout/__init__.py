"""rollout layer: staged model updates with analysis and rollback; see docs/rollout.md."""
