"""What tests/test_blocks.py and tests/test_blocks_errors.py share: random prompts and a
prompt admitted and computed in one call."""

import numpy as np

from pagedjax.blocks import BlockManager

RNG = np.random.default_rng(0)


def prompt(n: int, low: int = 0, high: int = 32000) -> list[int]:
    return RNG.integers(low, high, n).tolist()


def computed(bm: BlockManager, seq, tokens, salt=None) -> int:
    """Admits and fully computes a prompt; returns the cached token count."""
    cached = bm.admit(seq, tokens, cache_salt=salt)
    bm.mark_computed(seq, len(tokens))
    return cached
