"""Keeping a test process under Linux's limit on memory mappings.

Every program XLA compiles for the CPU holds memory mappings, and a test process keeps
every program it compiled (jax's caches): a worker running half the suite passed Linux's
default limit of 65,530 mappings (vm.max_map_count) and XLA crashed in mmap while
compiling (a segfault or an abort, in whichever test came then). `clear_if_crowded`
clears jax's caches once a process is past `MAPS_FRACTION` of its limit: tests/conftest.py
calls it between modules, and the engine fuzz between examples (one fuzz test compiles
programs for many engine configurations); what runs next recompiles what it needs.
"""

from __future__ import annotations

MAPS_FRACTION = 0.5


def _max_maps() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None  # (not Linux: no such limit to watch)


_MAX_MAPS = _max_maps()


def clear_if_crowded() -> bool:
    """Clears jax's caches if this process holds more than MAPS_FRACTION of its limit of
    memory mappings; whether it did."""
    if _MAX_MAPS is None:
        return False
    with open("/proc/self/maps", "rb") as f:
        maps = sum(1 for _ in f)
    if maps <= MAPS_FRACTION * _MAX_MAPS:
        return False
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    return True
