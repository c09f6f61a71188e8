"""`LLM`'s LoRA side (vLLM's `enable_lora` API): the engine arguments, the adapter of each
request, and `add_lora` / `remove_lora` / `list_loras`. The adapters themselves, their
device slots and the per-token update are `pagedjax.lora`'s.

A request with a `LoRARequest` runs with that adapter: its adapter is read (once per
`lora_int_id`) when the request is added, so a bad adapter is an error of
`add_request` / `generate`, before anything is queued; its group carries the id, which
the scheduler counts against `max_loras`; and its prefix-cache pages are salted with the
adapter's cache key (its id and path, or its weights' generation for one given from
memory), so they are shared only with requests of the same adapter (`lora_salt`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedjax.lora import LoRAAdapter, LoRARequest, LoRASlots
from pagedjax.prefix_cache import salt_bytes
from pagedjax.sequence import SequenceGroup
from pagedjax.step_input import is_int

__all__ = ["LoRAMixin", "check_lora_args", "lora_salt"]


def check_lora_args(enable_lora, max_loras, max_lora_rank, max_cpu_loras) -> None:
    """`LLM`'s LoRA arguments (as it documents them), before the model loads."""
    if not isinstance(enable_lora, bool):
        raise ValueError(f"enable_lora must be a bool, got {enable_lora=}")
    for name, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={v!r}")
    if max_cpu_loras is not None and (not is_int(max_cpu_loras) or max_cpu_loras < 0):
        raise ValueError(f"max_cpu_loras must be None or an int >= 0, got {max_cpu_loras=}")


def lora_salt(key: bytes, cache_salt: str | bytes | None) -> bytes:
    """The prefix-cache salt of a request with the adapter of cache key `key`
    (`LoRASlots.cache_key`) and its own `cache_salt`: bytes, which no request's own salt
    (a str) equals."""
    return b"lora:%d:%s" % (len(key), key) + salt_bytes(cache_salt)


class LoRAMixin:
    """`LLM`'s LoRA methods; `_init_lora` sets `self.lora` (None: LoRA not enabled)."""

    def _init_lora(self, enable_lora, max_loras, max_lora_rank, max_cpu_loras) -> LoRASlots | None:
        self.lora = None
        if enable_lora:
            self.lora = LoRASlots(
                self.config,
                int(max_loras),
                int(max_lora_rank),
                int(max_loras if max_cpu_loras is None else max_cpu_loras),
                self.params.mesh,
                self.scheduler.lora_ids,
            )
        return self.lora

    def _need_lora(self) -> LoRASlots:
        if self.lora is None:
            raise ValueError("LoRA is not enabled: make the engine with LLM(..., enable_lora=True)")
        return self.lora

    def add_lora(self, lora_request: LoRARequest, *, adapter: LoRAAdapter | None = None) -> bool:
        """Reads an adapter now and keeps it on the host until `remove_lora` (requests
        with it then start without reading it). Returns False if it was held already.

        `adapter`: weights from memory (`pagedjax.lora.adapter_from_state`, e.g. an
        adapter trained in JAX) to hold under `lora_request`'s id instead of reading its
        path (which then only names it). Giving an id new weights this way replaces the
        ones it had (an RL loop's update): later requests with the id run with the new
        ones and never reuse prefix-cache pages computed with the old. Returns True.

        Raises:
          ValueError: LoRA not enabled, or the adapter does not fit the model (or has a
            rank above `max_lora_rank`, or its id names another adapter's path), or new
            weights for an id a queued or running request uses.
          FileNotFoundError: no adapter at its path.
        """
        return self._need_lora().add(lora_request, pin=True, adapter=adapter)

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets adapter `lora_id` (its device slot too); returns whether it was held.
        ValueError if a queued or running request uses it."""
        return self._need_lora().remove(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters held on the host."""
        return set(self._need_lora().requests)

    def _lora_id(self, lora_request: LoRARequest | None) -> int:
        """The id a request runs with (0: none), its adapter read if it is new."""
        if lora_request is None:
            return 0
        self._need_lora().add(lora_request)
        return lora_request.lora_int_id

    def _set_lora(self, group: SequenceGroup, lora_id: int) -> None:
        if lora_id:
            group.lora_id = lora_id
            group.cache_salt = lora_salt(self.lora.cache_key(lora_id), group.cache_salt)

    @staticmethod
    def _per_prompt_loras(lora_request, n: int) -> list[LoRARequest | None]:
        """`generate`'s lora_request: one for every prompt, or a list of one per prompt."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        if not isinstance(lora_request, Sequence) or isinstance(lora_request, (str, bytes)):
            raise TypeError(
                "lora_request must be a LoRARequest, a list of them or None, got "
                f"{lora_request!r:.80}"
            )
        if len(lora_request) != n:
            raise ValueError(f"got {len(lora_request)} lora_requests for {n} prompts")
        return list(lora_request)
