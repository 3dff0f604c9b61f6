"""Where hetero keeps files between runs: the user's cache folder, `$XDG_CACHE_HOME/hetero`
(default `~/.cache/hetero`). Light on purpose: the CLI asks before it imports torch."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetero"


def profile_path() -> Path:
    """The hardware profile (`planner.profile`)."""
    return cache_dir() / "profile.json"
