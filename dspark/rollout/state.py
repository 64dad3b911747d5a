"""The controller's memory: rollouts, their events and pending commands in one SQLite file.

Every transition is written (and committed) *before* it is applied, so a controller killed at
any point can be restarted and finish or undo the step it was in (``Controller.recover``).
One controller per model at a time: ``ModelLock`` holds an exclusive ``flock`` on a file next
to the database, which the kernel releases when the process dies (kill -9 included), so a crash
never leaves a stale lock. The lock is per machine: two controllers on different machines that
share the state file over a network filesystem are not kept apart (SQLite itself is not safe
there either); run one controller host per repository.

A running controller also refreshes a heartbeat in the state file (``Heartbeat``, on a thread of
its own so a long load does not stop it); whoever reads the file, on any machine, tells a live
controller from a dead one by its age (``Lease.alive``).
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import socket
import sqlite3
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from dspark.errors import ConfigError, UnavailableError
from dspark.repository.modelspec import check_model_name

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    router TEXT,
    semver TEXT NOT NULL,
    current_version INTEGER NOT NULL,
    new_version INTEGER NOT NULL,
    phase TEXT NOT NULL,          -- staging, loading, warmup, step, promoting, draining, rolling_back, done
    step INTEGER NOT NULL DEFAULT -1,
    paused INTEGER NOT NULL DEFAULT 0,
    outcome TEXT,                 -- promoted, rolled_back
    reason TEXT,
    settings TEXT NOT NULL,       -- JSON: plan, servers, repository, routing file, artifact
    started TEXT NOT NULL,
    updated TEXT NOT NULL,
    finished TEXT
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id INTEGER NOT NULL REFERENCES rollouts(id),
    at TEXT NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL,
    data TEXT
);
CREATE TABLE IF NOT EXISTS commands (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    command TEXT NOT NULL,        -- rollback, promote, pause, resume
    reason TEXT,
    at TEXT NOT NULL,
    taken TEXT
);
CREATE TABLE IF NOT EXISTS controllers (
    model TEXT PRIMARY KEY,
    holder TEXT NOT NULL,         -- pid and host
    interval_s REAL NOT NULL,     -- how often it beats
    beat TEXT NOT NULL,           -- last heartbeat
    stopped TEXT                  -- when it exited (NULL while running, or when it was killed)
);
"""
ACTIVE = "phase != 'done'"
HEARTBEAT_ENV = "DSPARK_ROLLOUT_HEARTBEAT_S"
HEARTBEAT_S = 2.0
MISSED_BEATS = 2  # a lease this many intervals old belongs to a dead controller


# what to do about a state path this user cannot write
_WRITABLE_FIX = ("give the pod securityContext.fsGroup (deploy/k8s/rollout-job.yaml sets 10001, the image's "
                 "user), chown the folder to this user, or point --state / $DSPARK_ROLLOUT_STATE at a "
                 "writable path")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def default_state_path() -> Path:
    """``$DSPARK_ROLLOUT_STATE``, else ``$XDG_STATE_HOME/dspark/rollout.sqlite`` (~/.local/state)."""
    explicit = os.environ.get("DSPARK_ROLLOUT_STATE")
    if explicit:
        return Path(explicit)
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "dspark" / "rollout.sqlite"


@dataclass
class Rollout:
    id: int
    model: str
    router: Optional[str]
    semver: str
    current_version: int
    new_version: int
    phase: str
    step: int
    paused: bool
    outcome: Optional[str]
    reason: Optional[str]
    settings: dict
    started: str
    updated: str
    finished: Optional[str]

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> "Rollout":
        data = dict(row)
        data["settings"] = json.loads(data["settings"])
        data["paused"] = bool(data["paused"])
        return cls(**data)


@dataclass
class Lease:
    """The heartbeat of the controller of one model."""

    model: str
    holder: str
    interval_s: float
    beat: str
    stopped: Optional[str]

    def alive(self, at: Optional[_dt.datetime] = None) -> bool:
        """Running, and beat within the last ``MISSED_BEATS`` intervals."""
        at = at or _dt.datetime.now(_dt.timezone.utc)
        age = (at - _dt.datetime.fromisoformat(self.beat)).total_seconds()
        return self.stopped is None and age <= MISSED_BEATS * self.interval_s


def heartbeat_interval() -> float:
    """``$DSPARK_ROLLOUT_HEARTBEAT_S``, else 2 s."""
    text = os.environ.get(HEARTBEAT_ENV)
    if not text:
        return HEARTBEAT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ConfigError(HEARTBEAT_ENV, f"must be a number of seconds > 0, got {text!r}")
    return value


def _check_writable(path: Path) -> None:
    """ConfigError in one line unless this user can write ``path`` and its folder: SQLite (WAL)
    and the model locks create files beside it. A volume whose root is root-owned 0755, as block
    storage usually is, mounted in a pod that runs as uid 10001 without ``fsGroup``, made the
    Job's `recover` die with sqlite3's "unable to open database file" traceback."""
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError("state", f"cannot create the rollout state folder ({error.strerror}): "
                                   f"{_WRITABLE_FIX}", folder) from None
    for where in (folder, path):
        if where.exists() and not os.access(where, os.W_OK | (os.X_OK if where.is_dir() else 0)):
            info = where.stat()
            raise ConfigError("state", f"the rollout state {'folder' if where.is_dir() else 'file'} is not "
                                       f"writable by uid {os.geteuid()} (owner uid {info.st_uid}, gid "
                                       f"{info.st_gid}, mode {info.st_mode & 0o7777:04o}): {_WRITABLE_FIX}",
                              where)


class StateStore:
    """Rollouts, events and commands in SQLite (WAL; each call is its own committed transaction)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        _check_writable(self.path)
        try:
            self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as error:  # not a database, damaged, locked past the timeout
            raise ConfigError("state", f"cannot open the rollout state file: {error}", self.path) from None

    def close(self) -> None:
        self._db.close()

    def create(self, model: str, router: Optional[str], semver: str, current: int, new: int,
               settings: dict) -> Rollout:
        stamp = now()
        cursor = self._db.execute(
            "INSERT INTO rollouts (model, router, semver, current_version, new_version, phase, settings, started, updated)"
            " VALUES (?, ?, ?, ?, ?, 'staging', ?, ?, ?)",
            (model, router, semver, current, new, json.dumps(settings), stamp, stamp))
        return self.get(cursor.lastrowid)

    def get(self, rollout_id: int) -> Rollout:
        row = self._db.execute("SELECT * FROM rollouts WHERE id = ?", (rollout_id,)).fetchone()
        return Rollout.from_row(row)

    def active(self, model: str) -> Optional[Rollout]:
        row = self._db.execute(f"SELECT * FROM rollouts WHERE model = ? AND {ACTIVE} ORDER BY id DESC LIMIT 1",
                               (model,)).fetchone()
        return Rollout.from_row(row) if row else None

    def history(self, model: Optional[str] = None, limit: int = 50) -> list[Rollout]:
        if model:
            rows = self._db.execute("SELECT * FROM rollouts WHERE model = ? ORDER BY id DESC LIMIT ?", (model, limit))
        else:
            rows = self._db.execute("SELECT * FROM rollouts ORDER BY id DESC LIMIT ?", (limit,))
        return [Rollout.from_row(r) for r in rows.fetchall()]

    def update(self, rollout_id: int, **fields: Any) -> Rollout:
        if "settings" in fields:
            fields["settings"] = json.dumps(fields["settings"])
        if "paused" in fields:
            fields["paused"] = int(bool(fields["paused"]))
        fields["updated"] = now()
        assignments = ", ".join(f"{key} = ?" for key in fields)
        self._db.execute(f"UPDATE rollouts SET {assignments} WHERE id = ?", (*fields.values(), rollout_id))
        return self.get(rollout_id)

    def event(self, rollout_id: int, kind: str, message: str, data: Any = None) -> None:
        self._db.execute("INSERT INTO events (rollout_id, at, kind, message, data) VALUES (?, ?, ?, ?, ?)",
                         (rollout_id, now(), kind, message, None if data is None else json.dumps(data)))

    def events(self, rollout_id: int, kinds: Optional[tuple[str, ...]] = None) -> list[dict]:
        rows = self._db.execute("SELECT * FROM events WHERE rollout_id = ? ORDER BY id", (rollout_id,)).fetchall()
        out = []
        for row in rows:
            if kinds and row["kind"] not in kinds:
                continue
            item = dict(row)
            item["data"] = json.loads(item["data"]) if item["data"] else None
            out.append(item)
        return out

    # --- commands from `dspark rollout rollback/promote/pause/resume` to a running controller ---
    def send(self, model: str, command: str, reason: Optional[str] = None) -> None:
        self._db.execute("INSERT INTO commands (model, command, reason, at) VALUES (?, ?, ?, ?)",
                         (model, command, reason, now()))

    def take_commands(self, model: str) -> list[tuple[str, Optional[str]]]:
        with self.transaction():
            rows = self._db.execute("SELECT id, command, reason FROM commands WHERE model = ? AND taken IS NULL "
                                    "ORDER BY id", (model,)).fetchall()
            for row in rows:
                self._db.execute("UPDATE commands SET taken = ? WHERE id = ?", (now(), row["id"]))
        return [(row["command"], row["reason"]) for row in rows]

    def drop_commands(self, model: str) -> None:
        self._db.execute("UPDATE commands SET taken = ? WHERE model = ? AND taken IS NULL", (now(), model))

    # --- the running controller's heartbeat ---
    def beat(self, model: str, holder: str, interval_s: float) -> None:
        self._db.execute("INSERT INTO controllers (model, holder, interval_s, beat, stopped) VALUES (?, ?, ?, ?, NULL)"
                         " ON CONFLICT(model) DO UPDATE SET holder = excluded.holder, interval_s = excluded.interval_s,"
                         " beat = excluded.beat, stopped = NULL", (model, holder, interval_s, now()))

    def stopped(self, model: str) -> None:
        self._db.execute("UPDATE controllers SET stopped = ? WHERE model = ?", (now(), model))

    def lease(self, model: str) -> Optional[Lease]:
        row = self._db.execute("SELECT * FROM controllers WHERE model = ?", (model,)).fetchone()
        return Lease(**dict(row)) if row else None

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")


class Heartbeat:
    """Refreshes the lease of a model's controller every ``interval_s`` while it runs, on its own
    connection and thread; on exit the lease is marked stopped."""

    def __init__(self, state_path: Path, model: str, interval_s: Optional[float] = None):
        self.state_path, self.model = Path(state_path), model
        self.interval_s = interval_s or heartbeat_interval()
        self.holder = f"pid {os.getpid()} on {socket.gethostname()}"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Heartbeat":
        store = StateStore(self.state_path)
        store.beat(self.model, self.holder, self.interval_s)  # live before the first interval passes
        self._thread = threading.Thread(target=self._run, args=(store,), name="rollout-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self, store: StateStore) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                try:
                    store.beat(self.model, self.holder, self.interval_s)
                except sqlite3.OperationalError:  # busy for the store's 30 s timeout: the next beat tries again
                    continue
            store.stopped(self.model)
        finally:
            store.close()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class ModelLock:
    """An exclusive lock per (state file, model), held for the controller's lifetime."""

    def __init__(self, state_path: Path, model: str):
        self.path = Path(f"{state_path}.{check_model_name(model, 'model')}.lock")
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UnavailableError(f"another controller is running a rollout of this model ({holder}); "
                                   "use `dspark rollout rollback/promote/pause/resume` to steer it", "locked") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._fd = fd

    def held_by_other(self) -> bool:
        """Whether some other process holds the lock now (a controller is running)."""
        if self._fd is not None:
            return False
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops a lock we may just have taken
        return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "ModelLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
