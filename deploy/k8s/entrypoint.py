"""The Triton container of deploy/k8s: lay out dspark's backends for the bundled tritonserver and
exec it on the S3 repository plus the pod's local router repository, with explicit model control
behind the API key. Configuration from the environment (see triton-fleet.yaml):

  MODEL_REPOSITORY   s3://[host:port/]bucket/path of the shared repository
  LOCAL_REPOSITORY   the router's local repository (its routing file is synced by the sidecar)
  LOAD_MODELS        comma-separated models to load at start
  DSPARK_API_KEY     key of the restricted APIs (header dspark-api-key); it reaches tritonserver
                     through a pipe, not its command line or environment
"""
import os
import tempfile
from pathlib import Path

from dspark.paths import backends_dir
from dspark.server.launcher import ServerPorts, TritonServer
from dspark.server.access import DEFAULT_HEADER_PATTERN, SERVER_UMASK, header_forward_args
from dspark.server.install import build_backend_directory, find_server


def main() -> None:
    server = TritonServer(
        repositories=[Path(os.environ.get("LOCAL_REPOSITORY", "/models/local"))],
        ports=ServerPorts(8000, 8001, 8002),
        model_control="explicit",
        load_models=[m for m in os.environ.get("LOAD_MODELS", "").split(",") if m],
        host="0.0.0.0",  # a pod serves its cluster; the restricted APIs stay behind the key
        metrics_host="0.0.0.0",  # scraped by the cluster's Prometheus (the pod annotations say so)
        api_key=os.environ["DSPARK_API_KEY"],
        extra_args=[f"--model-repository={os.environ['MODEL_REPOSITORY']}",
                    *header_forward_args(DEFAULT_HEADER_PATTERN)],
    )
    install = find_server()
    backends = Path(tempfile.mkdtemp(prefix="dspark-backends-"))
    build_backend_directory(install, backends, backends_dir())
    command = server.command(install, backends)
    environment, key_fd = server.launch_environment(install)
    os.set_inheritable(key_fd, True)
    os.umask(SERVER_UMASK)
    os.execve(command[0], command, environment)


if __name__ == "__main__":
    main()
