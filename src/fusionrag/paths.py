"""Where fusionrag keeps converted models and other per-user caches."""

from __future__ import annotations

import os
from pathlib import Path


def fusionrag_home() -> Path:
    """``$FUSIONRAG_HOME`` or ``~/.cache/fusionrag``; created on first use."""
    home = Path(os.environ.get("FUSIONRAG_HOME") or Path.home() / ".cache" / "fusionrag")
    home.mkdir(parents=True, exist_ok=True)
    return home
