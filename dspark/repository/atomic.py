"""Writes a Triton server never sees half-done: a file through a temp file and ``os.replace``,
a version folder built beside its final place (same filesystem) and renamed into it.

Triton's poll mode (and an explicit load racing a copy) would otherwise load a version folder
whose artifact is still being written, or a truncated config.pbtxt. The temp names start with a
dot and are not numbers, so Triton never takes them for a version folder.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Union


def write_text(path: Union[str, Path], text: str, only_if_changed: bool = False) -> bool:
    """Write ``text`` to ``path`` atomically; with ``only_if_changed``, leave an identical file
    alone (a rewrite bumps its time stamp, which Triton's poll mode takes for a change). Returns
    whether the file was written."""
    path = Path(path)
    if only_if_changed and path.is_file() and path.read_text() == text:
        return False
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def install_folder(source: Union[str, Path], destination: Union[str, Path], file_name: str = "") -> Path:
    """Copy ``source`` (a folder, or one file saved as ``file_name``) to the new folder
    ``destination`` in one rename: the copy is built in a hidden sibling folder first."""
    source, destination = Path(source), Path(destination)
    if destination.exists():
        raise FileExistsError(f"{destination} already exists")
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{destination.name}-", dir=destination.parent))
    try:
        if source.is_dir():
            shutil.copytree(source, staging, dirs_exist_ok=True)
        else:
            shutil.copy2(source, staging / (file_name or source.name))
        os.rename(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination


def remove_leftovers(folder: Union[str, Path]) -> list[Path]:
    """Delete staging folders a killed writer left in ``folder``; returns what was removed."""
    removed = []
    for path in Path(folder).glob(".staging-*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
