"""Where the Triton server is: the nvidia-pytriton wheel's bundled server, $TRITONSERVER, or
one on PATH laid out as in NVIDIA's container; and the --backend-directory with dspark's
Python-based backends beside Triton's Python backend."""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dspark.server.access import ServerError

SERVER_ENV_VAR = "TRITONSERVER"
INSTALL_HINT = (
    "install the bundled server with `pip install nvidia-pytriton==0.7.0`, put `tritonserver` on PATH, "
    f"set {SERVER_ENV_VAR}=/path/to/tritonserver, or pass --server /path/to/tritonserver"
)
PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STUB_NAME = "triton_python_backend_stub"
@dataclass(frozen=True)
class ServerInstall:
    """One Triton installation: the binary, its Python backend, and what the stub needs to load."""

    binary: Path
    python_backend: Path
    stubs_by_python: Optional[Path] = None  # folder of <major.minor>/triton_python_backend_stub
    library_dirs: tuple[Path, ...] = ()

    def stub_for_running_python(self) -> Path:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        if self.stubs_by_python is not None:
            stub = self.stubs_by_python / version / STUB_NAME
            if stub.is_file():
                return stub
            raise ServerError(
                f"the server at {self.binary} ships no Python backend stub for Python {version} "
                f"(looked in {self.stubs_by_python}); run dspark with one of: "
                + ", ".join(sorted(p.name for p in self.stubs_by_python.iterdir()))
            )
        stub = self.python_backend / STUB_NAME
        if not stub.is_file():
            raise ServerError(f"no {STUB_NAME} in {self.python_backend}; the Python backend install is incomplete")
        return stub


def _pytriton_install() -> Optional[ServerInstall]:
    try:
        import pytriton  # noqa: F401  (the nvidia-pytriton wheel)
    except ImportError:
        return None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return ServerInstall(
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stubs_by_python=root / "python_backend_stubs",
        library_dirs=(libs,) if libs.is_dir() else (),
    )


def _system_install(binary: Path) -> ServerInstall:
    """A server laid out as in NVIDIA's container: <prefix>/bin/tritonserver, <prefix>/backends/python."""
    prefix = binary.resolve().parent.parent
    return ServerInstall(binary=binary, python_backend=prefix / "backends" / "python")


def find_server(explicit: Optional[str] = None) -> ServerInstall:
    """The server to run: an explicit path, then $TRITONSERVER, the nvidia-pytriton wheel, PATH."""
    candidate = explicit or os.environ.get(SERVER_ENV_VAR)
    if candidate:
        binary = Path(candidate)
        if not binary.is_file():
            raise ServerError(f"no Triton server at {binary}: {INSTALL_HINT}")
        bundled = _pytriton_install()
        if bundled is not None and bundled.binary.resolve() == binary.resolve():
            return bundled
        install = _system_install(binary)
    else:
        install = _pytriton_install()
        if install is None:
            on_path = shutil.which("tritonserver")
            if on_path is None:
                raise ServerError(f"no Triton server found: {INSTALL_HINT}")
            install = _system_install(Path(on_path))
    if not install.binary.is_file():
        raise ServerError(f"the Triton server binary {install.binary} is missing: {INSTALL_HINT}")
    if not os.access(install.binary, os.X_OK):
        raise ServerError(f"the Triton server {install.binary} is not executable: chmod +x it or reinstall")
    missing = [name for name in PYTHON_BACKEND_FILES if not (install.python_backend / name).is_file()]
    if missing:
        raise ServerError(
            f"Triton's Python backend is incomplete in {install.python_backend} (missing {', '.join(missing)}): "
            "reinstall the server with its Python backend"
        )
    return install


def build_backend_directory(install: ServerInstall, destination: Path, sources: Path) -> list[str]:
    """Lay out a --backend-directory: Triton's Python backend plus each backends/<name> of ours.

    Returns the names of our Python-based backends.
    """
    python_dir = destination / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in PYTHON_BACKEND_FILES:
        shutil.copy2(install.python_backend / name, python_dir / name)
    shutil.copy2(install.stub_for_running_python(), python_dir / STUB_NAME)
    names = []
    for backend in sorted(sources.iterdir()):
        if (backend / "model.py").is_file() and backend.name != "python":
            shutil.copytree(backend, destination / backend.name, ignore=shutil.ignore_patterns("__pycache__"))
            names.append(backend.name)
    return names
