"""The hardware profile, measured once and cached as JSON.

`measure()` (the work is `planner.measure`'s) takes under 30 s (on a fresh machine too: the CPU
kernels compile in background processes while the GPU is measured); `load_or_measure()` reuses
the cached file (in `$XDG_CACHE_HOME/hetero/profile.json`, default `~/.cache/hetero/`) and only
re-reads the figures that change from minute to minute (free memory). What a profile holds:
`planner.hardware`.
"""
from __future__ import annotations

import logging
from pathlib import Path

from hetero.paths import profile_path
from planner.hardware import (  # noqa: F401  (the profile's names, for the planner's users)
    FORMAT, HOST_KV_DTYPES, AttnRate, HardwareProfile, current_memory, estimate, host_memory, implausible,
    kernels_version, physical_cores,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- caching
def cache_path() -> Path:
    return profile_path()


def cached(path: Path | None = None) -> tuple[HardwareProfile | None, str]:
    """The cached profile with current free memory, or (None, why it cannot be used): missing,
    unreadable, of an older format, or measured with other CPU kernels than the installed ones."""
    path = path or cache_path()
    if not path.is_file():
        return None, "no cached profile"
    try:
        prof = HardwareProfile.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError) as e:
        return None, f"cannot read the cached profile {path} ({e})"
    if prof.versions.get("format") != str(FORMAT):
        return None, f"profile {path} is from an older format"
    if prof.versions.get("kernels") != kernels_version():
        return None, f"the hardware profile {path} was measured with other CPU kernels than the installed ones"
    return current_memory(prof), ""


def load_or_estimate(path: Path | None = None) -> HardwareProfile:
    """The cached profile when it is current, else `hardware.estimate()`: never measures (the CPU
    path's start-up; a CPU plan's choices do not depend on the rates)."""
    prof, _ = cached(path)
    return prof or estimate()


def load_or_measure(refresh: bool = False, path: Path | None = None) -> HardwareProfile:
    """The cached profile with current free memory, or a fresh measurement (then cached). A cached
    profile of another format, or measured with other CPU kernels than the installed ones, is
    measured again; a cache folder that cannot be written only costs the next run a measurement."""
    path = path or cache_path()
    if not refresh:
        prof, why = cached(path)
        if prof is not None:
            return prof
        if path.is_file():
            log.warning("%s; measuring again", why)
    prof = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(prof.to_json())
    except OSError as e:
        log.warning("note: cannot cache the hardware profile in %s (%s): it is measured again next time; "
                    "set XDG_CACHE_HOME to a writable folder", path, e.strerror or e)
    return prof


def measure(quick: bool = False) -> HardwareProfile:
    """Measure this machine (`planner.measure.measure`: < 30 s; `quick` uses small arrays, for tests)."""
    from planner import measure as measuring  # torch, Numba and the kernels: loaded on first use

    return measuring.measure(quick)
