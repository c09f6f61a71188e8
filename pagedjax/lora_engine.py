"""`LLM`'s LoRA side (vLLM's `enable_lora` API): the engine arguments, the adapter of each
request, `add_lora` / `remove_lora` / `pin_lora` / `list_loras`, and `LoRASlots`, the
engine's adapters on the host and in device slots. Reading adapters is
`pagedjax.lora_adapter`'s; the slots' layout and the per-token update are `pagedjax.lora`'s.

A request with a `LoRARequest` runs with that adapter: its adapter is read (once per
`lora_int_id`) when the request is added, so a bad adapter is an error of
`add_request` / `generate`, before anything is queued; its group carries the id, which
the scheduler counts against `max_loras`; and its prefix-cache pages are salted with the
adapter's cache key (its id, path and weights, or its weights' generation for one given
from memory), so they are shared only with requests of the same adapter (`lora_salt`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import jax
import numpy as np

from pagedjax import sharding
from pagedjax.lora import (
    LoRAAdapter,
    LoRARequest,
    LoRAWeights,
    check_adapter,
    create_lora_weights,
    load_adapter,
    write_slot,
)
from pagedjax.prefix_cache import salt_bytes
from pagedjax.sequence import SequenceGroup
from pagedjax.step_input import is_int

__all__ = ["LoRAMixin", "LoRASlots", "check_lora_args", "lora_salt"]


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


def _digest(adapter: LoRAAdapter) -> bytes:
    """A hex digest of an adapter's weights (which modules, their shapes and values)."""
    h = hashlib.blake2b(digest_size=16)
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        h.update(b"%d:%s:%r:%r;" % (layer, module.encode(), a.shape, b.shape))
        for x in (a, b):
            h.update(np.ascontiguousarray(x, np.float32).data)
    return h.hexdigest().encode()


def _same_path(a: str, b: str) -> bool:
    """Whether two spellings name one adapter: equal absolute paths, or the same place
    once symbolic links are resolved."""
    return os.path.abspath(a) == os.path.abspath(b) or os.path.realpath(a) == os.path.realpath(b)


class LoRASlots:
    """The engine's adapters: read from disk once per `lora_int_id` and kept on the host,
    the ones a step uses put in device slots (`LoRAWeights`), least recently used first
    out.

    The scheduler admits at most `max_loras` distinct adapters to run at once
    (`Scheduler(max_loras=...)`), so a step's adapters always fit the slots (`prepare`).
    The host keeps every adapter a queued or running request uses (`in_use`), the
    pinned ones (`add(pin=True)`, `pin`: `LLM.add_lora`, `LLM.pin_lora`), and up to
    `max_cpu_loras` others: reading a new adapter forgets the least recently used others
    beyond that.

    Each adapter held has a prefix-cache key (`cache_key`): its id, path and a digest of
    the weights read, so an id read again from the same path after it was forgotten
    finds its pages again if the files are unchanged, and an id given another adapter
    (another path, files changed on disk, or new weights from memory) does not find the
    old one's.

    Args:
      cfg: the base model's config.
      max_loras, max_lora_rank: the device slots (`create_lora_weights`).
      max_cpu_loras: most adapters kept on the host beyond the ones in use and pinned.
      mesh: the tensor-parallel mesh, or None.
      in_use: returns the adapter ids of the queued and running requests.
      device: without a mesh, the device the slots are committed to, the model's
        (`sharding.home_device`; None: uncommitted).
    """

    def __init__(self, cfg, max_loras, max_lora_rank, max_cpu_loras, mesh, in_use, device=None):
        self.cfg, self.max_loras, self.max_lora_rank = cfg, max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.mesh, self._in_use, self.device = mesh, in_use, device
        self.weights = self._empty()
        self.requests: dict[int, LoRARequest] = {}  # on the host, least recently used first
        self._adapters: dict[int, LoRAAdapter] = {}
        self.pinned: set[int] = set()
        self.slot_of: dict[int, int] = {}  # id -> device slot (1..max_loras)
        self._order: list[int] = []  # resident ids, least recently used first
        self._keys: dict[int, bytes] = {}
        self._replaced = 0  # adapters given from memory so far (their cache keys)

    def cache_key(self, lora_id: int) -> bytes:
        """The prefix-cache salt of adapter `lora_id`'s requests (it must be held)."""
        return self._keys[lora_id]

    def add(
        self,
        request: LoRARequest,
        *,
        pin: bool = False,
        adapter: LoRAAdapter | None = None,
        trim: bool = True,
    ) -> bool:
        """Reads `request`'s adapter unless held; returns whether it was read. A second
        request with its id must name the same path (ValueError otherwise: two adapters
        under one id would share prefix-cache pages).

        `adapter` (from memory, `adapter_from_state`) is held under `request`'s id
        instead of reading its path, replacing the adapter held under it: ValueError if
        a queued or running request uses that one.

        `trim=False` keeps every spare adapter held (beyond `max_cpu_loras`) until
        `trim()`: for adapters read before their requests are queued, which would
        otherwise push each other out and be read again."""
        if not isinstance(request, LoRARequest):
            raise TypeError(
                f"lora_request must be a pagedjax.lora.LoRARequest, got {request!r:.80}"
            )
        i = request.lora_int_id
        if adapter is not None:
            what = repr(request.lora_name)
            check_adapter(adapter, self.cfg, max_rank=self.max_lora_rank, what=what)
            adapter = self._own(adapter, what)
            if i in self.requests:
                self.remove(i)
            self._replaced += 1
            self._hold(request, adapter, b"%d:memory:%d" % (i, self._replaced), pin, trim)
            return True
        known = self.requests.get(i)
        if known is not None:
            if not _same_path(known.lora_path, request.lora_path):
                raise ValueError(
                    f"lora_int_id {i} is adapter {known.lora_path!r}, not {request.lora_path!r}: "
                    "give each adapter its own id"
                )
            self.requests[i] = self.requests.pop(i)  # most recently used
            if pin:
                self.pinned.add(i)
            return False
        adapter = load_adapter(request.lora_path, self.cfg, max_rank=self.max_lora_rank)
        adapter = self._own(adapter, repr(request.lora_path))
        path = os.path.abspath(request.lora_path).encode("utf-8", "surrogatepass")
        key = b"%d:path:%s:%s" % (i, _digest(adapter), path)
        self._hold(request, adapter, key, pin, trim)
        return True

    def _own(self, adapter: LoRAAdapter, what: str) -> LoRAAdapter:
        """`adapter` as the host holds it: float32 copies of its weights (a caller that
        changes its arrays afterwards, say an RL loop's update in place, changes nothing
        held: the prefix-cache key stands for the weights given), each checked finite in
        the slots' dtype (the model's), scaling included. ValueError otherwise: a NaN or
        infinity in any slot makes every row of each step it is in NaN (another slot's
        zero mask times it), whatever adapter the row has."""
        dtype = np.dtype(self.cfg.jnp_dtype)
        weights = {}
        for (layer, module), ab in sorted(adapter.weights.items()):
            a, b = (np.array(x, np.float32) for x in ab)
            peak = np.maximum(np.abs(a).max(), np.abs(b).max())  # (NaN if one is)
            with np.errstate(over="ignore", invalid="ignore"):
                finite = np.isfinite(peak.astype(dtype))  # (rounding is monotone)
            if not finite:
                raise ValueError(
                    f"LoRA adapter {what}: layer {layer} {module}: its weights (lora_alpha / r "
                    f"folded in) are not all finite in the model's dtype {dtype}"
                )
            weights[layer, module] = (a, b)
        return LoRAAdapter(weights, adapter.rank, adapter.path)

    def _hold(
        self, request: LoRARequest, adapter: LoRAAdapter, key: bytes, pin: bool, trim: bool
    ) -> None:
        i = request.lora_int_id
        self.requests[i], self._adapters[i], self._keys[i] = request, adapter, key
        if pin:
            self.pinned.add(i)
        if trim:
            self._trim(keep=i)

    def pin(self, lora_id: int) -> bool:
        """Keeps held adapter `lora_id` on the host until `remove` (as `add(pin=True)`);
        returns True. ValueError for an id not held, TypeError for one not an int."""
        if not is_int(lora_id):
            raise TypeError(f"lora_id must be an int, got {lora_id!r:.80}")
        if lora_id not in self.requests:
            raise ValueError(f"LoRA adapter {lora_id} is not held: add_lora it first")
        self.pinned.add(lora_id)
        return True

    def remove(self, lora_id: int) -> bool:
        """Forgets an adapter no queued or running request uses; returns whether it was held.
        ValueError if one does, TypeError for an id that is not an int."""
        if not is_int(lora_id):
            raise TypeError(f"lora_id must be an int, got {lora_id!r:.80}")
        if lora_id in self._in_use():
            raise ValueError(f"LoRA adapter {lora_id} is in use by a queued or running request")
        if lora_id not in self.requests:
            return False
        self._drop(lora_id)
        return True

    def _drop(self, i: int) -> None:
        del self.requests[i], self._adapters[i], self._keys[i]
        self.pinned.discard(i)
        if i in self.slot_of:  # its slot is free: zeroed when next written
            del self.slot_of[i]
            self._order.remove(i)

    def trim(self) -> None:
        """Forgets the least recently used spare adapters (neither in use nor pinned)
        beyond `max_cpu_loras`, as reading a new one does."""
        self._trim(keep=None)

    def _trim(self, keep: int | None) -> None:
        keep_ids = self._in_use() | self.pinned | {keep}
        spare = [i for i in self.requests if i not in keep_ids]
        for i in spare[: max(0, len(spare) - self.max_cpu_loras)]:
            self._drop(i)

    def prepare(self, ids) -> dict[int, int]:
        """Puts adapters `ids` in device slots (evicting the least recently used others);
        returns {id: slot} for them, with 0: 0 (no adapter)."""
        ids = set(ids) - {0}
        if len(ids) > self.weights.num_slots:  # the scheduler's max_loras prevents it
            raise RuntimeError(
                f"a step with {len(ids)} LoRA adapters > {self.weights.num_slots} slots"
            )
        for i in ids:
            if i in self.slot_of:
                self._order.remove(i)
                self._order.append(i)
                continue
            taken = set(self.slot_of.values())
            free = [s for s in range(1, self.weights.num_slots + 1) if s not in taken]
            if not free:
                victim = next(j for j in self._order if j not in ids)
                free = [self.slot_of.pop(victim)]
                self._order.remove(victim)
            self.weights = write_slot(self.weights, free[0], self._adapters[i])
            self.slot_of[i] = free[0]
            self._order.append(i)
        return {0: 0, **{i: self.slot_of[i] for i in ids}}

    def reset_device(self) -> None:
        """Deletes the device slots (`LLM.sleep`); `restore_device` makes empty ones."""
        for x in jax.tree.leaves(self.weights):
            x.delete()
        self.weights = None
        self.slot_of.clear()
        self._order.clear()

    def restore_device(self) -> None:
        """Empty device slots again after `reset_device` (`LLM.wake_up`)."""
        if self.weights is None:
            self.weights = self._empty()

    def _empty(self) -> LoRAWeights:
        return create_lora_weights(
            self.cfg, self.max_loras, self.max_lora_rank, self.mesh, device=self.device
        )


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
                lambda: self.scheduler.lora_ids(),  # (the scheduler comes later)
                sharding.home_device(self.params),
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
            rank above `max_lora_rank`, or its id names another adapter's path, or its
            weights are not all finite in the model's dtype), or new weights for an id
            a queued or running request uses.
          FileNotFoundError: no adapter at its path.
        """
        return self._need_lora().add(lora_request, pin=True, adapter=adapter)

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets adapter `lora_id` (its device slot too); returns whether it was held.
        ValueError if a queued or running request uses it."""
        return self._need_lora().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        """Keeps adapter `lora_id`, held already (read for a request, say), on the host
        until `remove_lora`, as `add_lora` does (vLLM's `pin_lora`); returns True.

        Raises:
          ValueError: LoRA not enabled, or no adapter `lora_id` is held.
          TypeError: `lora_id` is not an int.
        """
        return self._need_lora().pin(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters held on the host."""
        return set(self._need_lora().requests)

    def _read_lora(self, lora_request: LoRARequest | None) -> None:
        """Reads a request's adapter if it is new (None: nothing), keeping the spare ones
        until `LoRASlots.trim()`: for a call that reads its adapters before queueing its
        requests (`generate`), which would otherwise push each other out."""
        if lora_request is not None:
            self._need_lora().add(lora_request, trim=False)

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
