"""A progress bar for long runs (tqdm on stderr); without a terminal, one line per finished step."""
from __future__ import annotations

import sys
from typing import Callable


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool | None = None,
                 echo: Callable[[str], None] | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.echo = echo or (lambda text: print(text, file=sys.stderr))
        self.last = ""
        self.bar = None
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True)

    def note(self, text: str) -> None:
        """What the current step is doing (the bar's postfix)."""
        self.last = text
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
        elif self.last:
            self.echo(self.last)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *_) -> None:
        self.close()


class Silent(Progress):
    def __init__(self) -> None:
        super().__init__(0, "", enabled=False, echo=lambda _: None)
