"""server layer: the launcher, which runs in the user's process (dspark serve, bench, rollout):
finding and installing tritonserver, starting and stopping it, its API key and addresses, the
priority of its model stubs. Nothing here runs inside a stub (that is dspark.triton); see
docs/ARCHITECTURE.md."""
