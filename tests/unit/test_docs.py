"""The user docs say what is true now: no run stories (dated runs, the project's issue numbers).
History goes to CHANGELOG.md."""
from __future__ import annotations

import re

from dspark.paths import project_root

# "server issue 7588" and the like are upstream references, not this project's history
_STORY = re.compile(r"(?<!server )\bissue \d+\b|\bon 20\d\d-\d\d-\d\d\b", re.IGNORECASE)


def test_docs_carry_no_run_stories():
    root = project_root()
    found = []
    for path in sorted((root / "docs").rglob("*.md")) + [root / "README.md"]:
        if not path.exists():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _STORY.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_scheduler_docstring_names_the_threaded_runtime():
    import dspark.routing.scheduler as scheduler

    assert "asyncio" not in (scheduler.__doc__ or "")
