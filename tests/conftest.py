"""Session-wide test settings.

scripts/generate.py keeps a persistent XLA compilation cache under ~/.cache by
default; the tests run it in-process and in subprocesses, and must not write
into the user's home or reuse programs compiled by an earlier run. The one test
of the cache (tests/test_generate_cli.py) passes a temporary directory.
"""

import os

import pytest
import xla_maps
from hypothesis import settings

os.environ["PAGEDJAX_COMPILATION_CACHE"] = "off"

# Property tests draw the same examples on every run ("derandomized", the default here),
# so the suite and CI pass or fail on the code, not on the draw; a hunt for new examples
# runs `pytest --hypothesis-profile=hunt [--hypothesis-seed=N]` (fresh draws each run;
# CI once met a detokenizer bug on a fresh draw, tests/test_tokenizer.py has it now).
settings.register_profile("derandomized", derandomize=True)
settings.register_profile("hunt", derandomize=False)
settings.load_profile("derandomized")

# The tests check numerics, not the speed of the CPU code XLA generates: LLVM at -O0
# compiles the many small programs (every interpreted kernel shape is one) faster,
# which takes 15-25% off the suite on CI's 2 cores. Set before JAX creates its CPU
# client; subprocesses (scripts run by the tests, tests/tp_cases.py) inherit it.
_O0 = "--xla_backend_optimization_level=0"
if _O0 not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_O0}".strip()


# Modules holding the longest tests (each 15-46 s on CI's 2 cores), collected first:
# pytest-xdist hands tests out in collection order, so a long test collected late can
# start last and leave the other worker idle for its whole run. Whole modules move, so
# their module-scoped fixtures are still set up once. A module missing here only keeps
# its place.
LONG_MODULES = (
    "test_tensor_parallel.py",  # tp = 1..8 in a subprocess: ~60 s, ~45 s in -m slow
    "test_engine_fuzz.py",  # -m slow: three seeded fuzzes of 40-80 s each; 25 s by default
    "test_readme.py",  # three README examples, 14-21 s each
    "test_blocks.py",  # -m slow: the state machines, 29 s (sha256)
    "test_demo_model.py",  # -m slow: long interpreted-kernel runs, 20 s
    "test_decode.py",  # -m slow: long interpreted-kernel runs, 18 s
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        return LONG_MODULES.index(name) if name in LONG_MODULES else len(LONG_MODULES)

    items.sort(key=rank)  # stable: the order within each module is kept


def pytest_runtest_teardown(item, nextitem):
    # Between modules, a process with many compiled programs clears jax's caches
    # (tests/xla_maps.py: past Linux's limit on mappings, XLA crashed while compiling).
    if nextitem is None or nextitem.module is not item.module:
        xla_maps.clear_if_crowded()


# The weight-update tests' weights (tests/test_weight_sync.py, tests/test_wake_tags.py,
# tests/test_pause.py): the tiny preset's random weights before and after an update.
@pytest.fixture(scope="session")
def old():
    from engine_helpers import random_params  # (after XLA_FLAGS above)

    return random_params(0)


@pytest.fixture(scope="session")
def new():
    from engine_helpers import random_params

    return random_params(1)


@pytest.fixture(scope="session")
def want(old, new):
    """Dense greedy continuations (6 tokens) of `engine_helpers.UPDATE_PROMPTS` under
    each set of weights."""
    from engine_helpers import UPDATE_PROMPTS, Dense

    return {k: Dense(p).greedy(UPDATE_PROMPTS, 6) for k, p in (("old", old), ("new", new))}
