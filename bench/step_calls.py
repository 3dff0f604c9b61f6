"""The main thread's time in a decode step's calls, timed from outside the engine: wrappers on its
methods for a few steps, beside the kernels' own clocks (`bench.budget --calls`). Calls nest (a
layer's `front` holds its graph launches), so the rows overlap; each wrapper adds ~1 µs a call."""
from __future__ import annotations

import functools
import importlib
import time
from contextlib import contextmanager
from typing import Iterator

# (module, class, methods) timed
CALLS = (
    ("offload.runner", "Runner", ("decode", "_part", "_begin_stream", "start_layer", "finish_layer")),
    ("offload.steps", "LeanStep", ("run",)),
    ("offload.steps", "PipelinedStep", ("run",)),
    ("offload.inline", "InlineLayers", ("front", "host", "back")),
    ("offload.driver", "Driver", ("launch", "record", "synchronize")),
    ("offload.stream", "KVStreamer", ("take", "prefetch")),
    ("hetero.model", "Model", ("logits",)),
)


@contextmanager
def timed_calls() -> Iterator[dict[str, list[float]]]:
    """Within: every call of `CALLS`' methods timed → {"Class.method": [seconds, calls]}; the
    methods are restored on leaving."""
    found: dict[str, list[float]] = {}
    saved = []
    for module, cls_name, methods in CALLS:
        cls = getattr(importlib.import_module(module), cls_name)
        for m in methods:
            f = cls.__dict__[m]
            key = f"{cls_name}.{m}"
            found[key] = [0.0, 0]
            inner = f.__func__ if isinstance(f, staticmethod) else f

            def timed(*a, _f=inner, _acc=found[key], **kw):
                t = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    _acc[0] += time.perf_counter() - t
                    _acc[1] += 1

            functools.update_wrapper(timed, inner)
            saved.append((cls, m, f))
            setattr(cls, m, staticmethod(timed) if isinstance(f, staticmethod) else timed)
    try:
        yield found
    finally:
        for cls, m, f in saved:
            setattr(cls, m, f)


def per_step(found: dict[str, list[float]], steps: int) -> dict[str, dict[str, float]]:
    """The calls made, by time a step: ms a step, calls a step, µs a call."""
    rows = sorted(((k, s, n) for k, (s, n) in found.items() if n), key=lambda r: -r[1])
    return {k: dict(ms_a_step=round(s / steps * 1e3, 3), calls_a_step=round(n / steps, 1), us_a_call=round(s / n * 1e6, 1))
            for k, s, n in rows}
