"""The one way bench/ reads a JSON file: its document, or a ConfigError naming the file (and the
field it was read for) in one line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path | str, field: str = "") -> Any:
    """The parsed document of ``path``; ConfigError(field, "cannot read: ..." / "not JSON: ...")."""
    from dspark.errors import ConfigError

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(field, f"cannot read: {error.strerror or error}", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(field, f"not JSON: {error}", path) from None
