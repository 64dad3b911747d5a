"""`dspark serve`'s signal forwarding, without a server."""
from __future__ import annotations

import signal

import click

from dspark.cli import serve as serve_cli


class StoppedServer:
    """A server that has exited cleanly by the time it is waited for."""

    def wait(self):
        return 0

    def stop(self):
        pass


def test_the_ready_line_comes_after_the_signals_are_forwarded(monkeypatch):
    """A supervisor may stop the server the moment it reads the ready line: a SIGTERM before the
    handler is installed would kill `dspark serve` itself and leave tritonserver running."""
    events = []
    monkeypatch.setattr(signal, "signal", lambda signum, handler: events.append(signal.Signals(signum).name))
    monkeypatch.setattr(click, "echo", lambda text, **_: events.append(text))
    serve_cli.serve_until_signal(StoppedServer(), None, "dspark: ready")
    assert events == ["SIGINT", "SIGTERM", "dspark: ready"]
