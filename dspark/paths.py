"""Where the project's folders are: the checkout this package was installed from (editable)."""
import os
from pathlib import Path


def project_root() -> Path:
    """The folder holding backends/, model_repository/ and ensembles/.

    `DSPARK_HOME` overrides it (e.g. for a non-editable install next to a copy of those folders).
    """
    override = os.environ.get("DSPARK_HOME")
    return Path(override).resolve() if override else Path(__file__).resolve().parent.parent


def backends_dir() -> Path:
    return project_root() / "backends"


def demo_repositories() -> list[Path]:
    """The demo model repository and the ensembles over it, served together."""
    root = project_root()
    return [root / "model_repository", root / "ensembles"]
