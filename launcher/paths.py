"""Where vramfit keeps what outlives a run: one root for its caches (tokenized data, this machine's
calibration, the planner's traces)."""

from __future__ import annotations

import os


def cache_root() -> str:
    """``$VRAMFIT_CACHE``, else ``$XDG_CACHE_HOME/vramfit``, else ``~/.cache/vramfit``."""
    return os.environ.get("VRAMFIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vramfit")
