"""The shared model repository a rollout publishes to: a local folder or an S3 bucket.

Both give the controller the same few operations. Publishing is ordered so that a server never
sees a half-written version: the version folder is complete before ``config.pbtxt`` names it
(the version policy lists the served folders explicitly), and each file replaces its previous
content in one step (a rename locally, one PUT on S3).

S3 URLs are Triton's: ``s3://bucket/path`` (AWS) or ``s3://host:port/bucket/path`` (an S3
endpoint such as MinIO or moto; plain http, as Triton uses for it). Credentials come from the
usual AWS environment variables.
"""
from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

from dspark.errors import ConfigError
from dspark.repository import atomic

S3_URL = re.compile(r"^s3://(?:(?P<host>[^/:]+):(?P<port>\d+)/)?(?P<bucket>[^/]+)/?(?P<prefix>.*)$")


class LocalStore:
    def __init__(self, root: Union[str, Path]):
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError("repository", "folder does not exist", self.root)

    @property
    def url(self) -> str:
        return str(self.root.resolve())

    def read_text(self, relative: str) -> Optional[str]:
        path = self.root / relative
        return path.read_text() if path.is_file() else None

    def write_text(self, relative: str, text: str) -> None:
        atomic.write_text(self.root / relative, text, only_if_changed=True)

    def exists(self, relative: str) -> bool:
        return (self.root / relative).exists()

    def install_folder(self, relative: str, source: Path, file_name: str) -> None:
        atomic.install_folder(source, self.root / relative, file_name)

    def remove_folder(self, relative: str) -> None:
        shutil.rmtree(self.root / relative, ignore_errors=True)

    def clean_staging(self, model: str) -> list[str]:
        return [str(p) for p in atomic.remove_leftovers(self.root / model)]


class S3Store:
    def __init__(self, url: str):
        match = S3_URL.match(url)
        if not match:
            raise ConfigError("repository", f"{url!r} is not an S3 URL like s3://bucket/path or "
                                            "s3://host:port/bucket/path")
        import boto3  # only S3 repositories need it

        self._url = url.rstrip("/")
        self.bucket = match["bucket"]
        self.prefix = match["prefix"].strip("/")
        endpoint = f"http://{match['host']}:{match['port']}" if match["host"] else None
        self.client = boto3.client("s3", endpoint_url=endpoint)

    @property
    def url(self) -> str:
        return self._url

    def _key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def read_text(self, relative: str) -> Optional[str]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(relative))["Body"]
        except self.client.exceptions.NoSuchKey:
            return None
        return body.read().decode()

    def write_text(self, relative: str, text: str) -> None:
        if self.read_text(relative) != text:
            self.client.put_object(Bucket=self.bucket, Key=self._key(relative), Body=text.encode())

    def _keys(self, relative: str) -> list[str]:
        prefix = self._key(relative).rstrip("/") + "/"
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys += [item["Key"] for item in page.get("Contents", [])]
        return keys

    def exists(self, relative: str) -> bool:
        return bool(self._keys(relative)) or self.read_text(relative) is not None

    def install_folder(self, relative: str, source: Path, file_name: str) -> None:
        if self._keys(relative):
            raise FileExistsError(f"{self.url}/{relative} already exists")
        files = [(p, p.relative_to(source).as_posix()) for p in sorted(source.rglob("*")) if p.is_file()] \
            if source.is_dir() else [(source, file_name or source.name)]
        if not files:  # Triton does not see an S3 "folder" without an object in it
            self.client.put_object(Bucket=self.bucket, Key=self._key(f"{relative}/.keep"), Body=b"")
        for path, name in files:
            self.client.upload_file(str(path), self.bucket, self._key(f"{relative}/{name}"))

    def remove_folder(self, relative: str) -> None:
        keys = self._keys(relative)
        for start in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket,
                                       Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]]})

    def clean_staging(self, model: str) -> list[str]:
        return []  # nothing is staged under another name on S3: a folder is unused until config.pbtxt names it


def open_store(location: Union[str, Path]) -> Union[LocalStore, S3Store]:
    return S3Store(str(location)) if str(location).startswith("s3://") else LocalStore(location)


def load_routing(location: str):
    """The routing config at a local path or an S3 URL (``s3://[host:port/]bucket/key``), read
    with ``dspark.routing.config``'s own load (an S3 object goes through a temp file)."""
    from dspark.routing.config import RoutingConfig

    if not location.startswith("s3://"):
        return RoutingConfig.load(Path(location))
    store, key = _s3_object(location)
    text = store.read_text(key)
    if text is None:
        raise ConfigError("routing-file", "no such object", location)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "routing.yaml"
        path.write_text(text)
        return RoutingConfig.load(path)


def save_routing(config, location: str) -> None:
    """Write a routing config atomically: a rename locally, one PUT on S3."""
    if not location.startswith("s3://"):
        config.save(Path(location))
        return
    store, key = _s3_object(location)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "routing.yaml"
        config.save(path)
        store.write_text(key, path.read_text())


def _s3_object(url: str) -> tuple["S3Store", str]:
    folder, _, key = url.rpartition("/")
    return S3Store(folder), key


def sync_file(source: str, destination: Path, interval_s: float = 1.0, once: bool = False) -> None:
    """Keep ``destination`` (a local file) equal to the S3 object ``source``: the sidecar that
    lets routers on many pods read one routing file the controller writes to S3."""
    import time

    store, key = _s3_object(source)
    destination = Path(destination)
    while True:
        text = store.read_text(key)
        if text is not None:
            atomic.write_text(destination, text, only_if_changed=True)
        if once:
            return
        time.sleep(interval_s)
