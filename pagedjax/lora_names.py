"""`LoRANames`: a server's table of LoRA adapters by name (vLLM's `--lora-modules`),
which it changes while serving (vLLM's runtime LoRA updating) on the `EngineThread`
that owns the engine (`pagedjax.serving`, which re-exports it), consistently with the
requests it queues there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedjax.lora import LoRARequest
    from pagedjax.serving import EngineThread

__all__ = ["LoRANames"]


class LoRANames:
    """The LoRA adapters served by name beside a model (vLLM's `--lora-modules`), which
    `load` and `unload` change while serving (vLLM's runtime LoRA updating) through the
    `EngineThread` that owns the `LLM` (`LLM.add_lora` / `remove_lora` on its thread).

    Thread safety: `names` is replaced whole by each change, never changed in place, so a
    reader on any thread that reads it once has a consistent snapshot. The changes and
    `submit` hold one lock: a request is queued either before an `unload` of its adapter
    (which then finds the adapter in use and refuses) or after it (its name is gone),
    never with an adapter the engine has just forgotten.

    Ids are never reused: an adapter loaded again, maybe rewritten at the same path, gets
    a new id and so a new prefix-cache key (`LoRASlots.cache_key`: its id and path), and
    never hits pages computed with the old weights.

    Args:
      model_name: the served model's name, which no adapter may take.
      modules: `LoRARequest`s of the adapters served from the start (their reading is
        the caller's); their names must differ from each other and from `model_name`
        (ValueError). Adapters loaded later get ids above theirs.

    Attributes:
      names: {name: LoRARequest} of the adapters served now, in the order they came.
    """

    def __init__(self, model_name: str, modules: Iterable[LoRARequest] = ()):
        from pagedjax.lora import LoRARequest

        names: dict[str, LoRARequest] = {}
        for r in modules:
            if not isinstance(r, LoRARequest):
                raise TypeError(f"lora_modules must hold pagedjax.lora.LoRARequests, got {r!r:.80}")
            if r.lora_name == model_name:
                raise ValueError(f"LoRA module name {r.lora_name!r} is the served model's name")
            if r.lora_name in names:
                raise ValueError(f"LoRA module name {r.lora_name!r} is given twice")
            names[r.lora_name] = r
        self.model_name = model_name
        self.names = names
        self._next_id = max((r.lora_int_id for r in names.values()), default=0) + 1
        self._lock = threading.Lock()

    def load(self, engine: EngineThread, name: str, path: str) -> LoRARequest:
        """Reads the adapter at `path` into the engine, on its thread, and serves it as
        `name` under a new id. Nothing changes if it raises.

        Raises:
          ValueError: `name` is the model's or a served adapter's, or the engine refuses
            the adapter (LoRA not enabled, shapes that do not fit the model, a rank
            above its max_lora_rank; the message names it).
          FileNotFoundError: no adapter at `path`.
          EngineStopped: the engine thread is not running.
        """
        from pagedjax.lora import LoRARequest

        with self._lock:
            if name == self.model_name:
                raise ValueError(f"The lora adapter name {name!r} is the served model's name.")
            if name in self.names:
                raise ValueError(f"The lora adapter {name!r} has already been loaded.")

            def add(llm) -> LoRARequest:
                # Above the engine's own ids too: one added to the LLM before it was served.
                i = max(self._next_id, max(llm.list_loras(), default=0) + 1)
                r = LoRARequest(name, i, path)
                llm.add_lora(r)
                return r

            # No timeout: a caller that gave up would leave the engine and `names` apart.
            r = engine.call(add, timeout=None)
            self._next_id = r.lora_int_id + 1
            self.names = {**self.names, name: r}
        return r

    def unload(self, engine: EngineThread, name: str) -> LoRARequest:
        """Stops serving adapter `name` and has the engine forget it, on its thread.
        Nothing changes if it raises.

        Raises:
          KeyError: no adapter is served as `name`.
          ValueError: a queued or running request uses it (unload it once they finish).
          EngineStopped: the engine thread is not running.
        """
        with self._lock:
            r = self.names.get(name)
            if r is None:
                raise KeyError(name)
            try:
                engine.call(lambda llm: llm.remove_lora(r.lora_int_id), timeout=None)
            except ValueError:
                raise ValueError(
                    f"The lora adapter {name!r} is in use by a queued or running request; "
                    "unload it once they finish."
                ) from None
            self.names = {k: v for k, v in self.names.items() if k != name}
        return r

    def submit(self, engine: EngineThread, requests: list[tuple], sink, *, tokens: bool, name: str):
        """`engine.submit` of `(request id, token ids, params, priority)` requests that run
        with adapter `name`, looked up and queued under the lock (see the class
        docstring). Returns the adapter's `LoRARequest`.

        Raises:
          KeyError: no adapter is served as `name` (any more).
          TypeError, EngineStopped: as `EngineThread.submit`.
        """
        with self._lock:
            r = self.names.get(name)
            if r is None:
                raise KeyError(name)
            engine.submit([(*req, r) for req in requests], sink, tokens=tokens)
        return r
