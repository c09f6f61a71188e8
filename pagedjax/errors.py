"""What the block manager raises: one hierarchy under `BlockManagerError`.

Each error also derives from the builtin a caller would catch without knowing
pagedjax (`KeyError`, `ValueError`, `RuntimeError`, `AssertionError`), and every
message names the bad value. `pagedjax.blocks` re-exports them all.
"""

from __future__ import annotations

__all__ = [
    "BlockManagerError",
    "InvalidArgument",
    "InvalidState",
    "InvariantViolation",
    "OutOfPages",
    "SequenceExists",
    "SequenceFreed",
    "UnknownSequence",
]


class BlockManagerError(Exception):
    """Base class of every error the block manager raises."""


class OutOfPages(BlockManagerError):
    """Not enough free or evictable pages; nothing was allocated. Preempt and retry.

    ``available`` excludes the ``reserved`` pages promised to prompts admitted with
    ``peak_pages``, which are free but not for this call.
    """

    def __init__(self, needed: int, available: int, what: str, *, reserved: int = 0):
        more = f" ({reserved} more are reserved for prompts admitted with peak_pages)"
        super().__init__(
            f"{what} needs {needed} pages, only {available} free or evictable"
            + (more if reserved else "")
        )
        self.needed = needed
        self.available = available
        self.reserved = reserved


class UnknownSequence(BlockManagerError, KeyError):
    """The sequence id is not live (never admitted, or already freed)."""

    def __str__(self) -> str:  # KeyError would quote the message.
        return str(self.args[0])


class SequenceFreed(UnknownSequence):
    """The sequence was freed already: double free, or use after finish."""


class SequenceExists(BlockManagerError, ValueError):
    """Admit or fork to a sequence id that is live."""


class InvalidArgument(BlockManagerError, ValueError):
    """A bad value: empty or too long prompt, bad token id, bad count or range."""


class InvalidState(BlockManagerError, RuntimeError):
    """The call does not fit the sequence's state (e.g. append before prefill is done)."""


class InvariantViolation(BlockManagerError, AssertionError):
    """``check_invariants`` found inconsistent bookkeeping (a bug)."""
