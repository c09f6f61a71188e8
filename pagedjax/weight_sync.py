"""New weights for a running engine: the policy update of a reinforcement-learning loop.

An RL loop alternates generating rollouts with the current policy and training it:

    llm = LLM(params)                       # the inference copy (e.g. bfloat16)
    for it in range(steps):
        outs = llm.generate(prompts, sp)    # rollouts
        llm.sleep()                         # KV cache deleted, weights to host memory
        state = train_step(state, outs)     # float32 master weights, sharded as training likes
        llm.update_params(state.params)     # no reload, no recompile
        llm.wake_up()                       # a new KV cache

An asynchronous loop, whose rollouts run across policy updates, pauses the engine
instead of waiting for it to be idle (vLLM's `pause_generation`): `pause_generation(
mode="keep")` completes the step in flight and keeps the unfinished requests (by
default recomputed after the pause, their K/V freed), `update_params` (and `sleep`,
`wake_up`) run, and `resume_generation` goes on.

`LLM` (`pagedjax.engine`) inherits those calls from `WeightsMixin` here (kept out of
the engine's module, which is long enough). `update_params` calls `place_params`: the
new weights must be the same parameters (dotted paths, `model.params_to_flat`'s) with
the same shapes; floating-point ones are cast to the engine's dtype, as loading a
checkpoint casts them, and every array is placed as the engine's is (its device, or its
sharding over the tensor-parallel mesh), so the jitted steps run them with the programs
they compiled (same tree, shapes, dtypes and shardings). The engine holds
`template(params)`, the shape, dtype and sharding of each array, so that weights it
dropped (`LLM.sleep(level=2)`) can be replaced all the same, and weights `sleep` moved
to host memory (`to_host`) go back where the compiled programs expect them.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax import model as model_lib
from pagedjax.request import RequestOutput

__all__ = ["WeightsMixin", "place_params", "template", "to_host"]


def template(params: model_lib.Params) -> model_lib.Params:
    """`params` with each array replaced by its `jax.ShapeDtypeStruct` (sharding
    included): what new weights must match, without holding the old ones."""

    def spec(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    return jax.tree.map(spec, params)


def to_host(params: model_lib.Params) -> model_lib.Params:
    """`params` copied to host memory (each array's sharding with memory kind
    "pinned_host", which `jax.device_put` back to the original sharding undoes); as
    they are where a device has no such memory."""
    first = jax.tree.leaves(params)[0]
    kinds = {m.kind for d in first.sharding.device_set for m in d.addressable_memories()}
    if "pinned_host" not in kinds:
        return params
    return jax.tree.map(
        lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), params
    )


def _flat(new) -> dict:
    """{dotted path: array} of new weights given as `Params`, an `nnx.State` (a training
    loop's `nnx.state(model)`) or such a dict already."""
    if isinstance(new, model_lib.Params):
        return model_lib.params_to_flat(new)
    if isinstance(new, nnx.State):
        return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(new)}
    if isinstance(new, Mapping):
        bad = [k for k in new if not isinstance(k, str)]
        if bad:
            raise TypeError(f"a weights dict's keys must be dotted paths (str), got {bad[0]!r}")
        return dict(new)
    raise TypeError(
        "new weights must be pagedjax.model.Params, an nnx.State or a {dotted path: array} "
        f"dict (model.params_to_flat's), got {type(new).__name__}"
    )


def place_params(like: model_lib.Params, new) -> model_lib.Params:
    """`new` weights as `Params` shaped, typed and placed as `like` (a `Params` or its
    `template`), with `like`'s structure, config and mesh.

    Arrays already in the engine's dtype and placement are kept, not copied (as
    `LLM(params)` keeps them): a training step that donates them deletes the engine's
    weights too.

    Raises:
      TypeError: `new` is none of the accepted kinds.
      ValueError: a parameter missing, unexpected, of another shape, not floating
        point, or deleted (donated), naming each (all at once).
    """
    flat = _flat(new)
    want = list(nnx.to_flat_state(like.state))
    keys = [".".join(map(str, p)) for p, _ in want]
    missing = [k for k in keys if k not in flat]
    unexpected = sorted(set(flat) - set(keys))
    bad = []
    for key, (_, var) in zip(keys, want, strict=True):
        if key not in flat:
            continue
        x, spec = flat[key], var.get_value()
        shape, dtype = tuple(np.shape(x)), getattr(x, "dtype", None)
        if shape != tuple(spec.shape):
            bad.append(f"{key}: shape {shape}, the model's is {tuple(spec.shape)}")
        elif dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            bad.append(f"{key}: dtype {dtype}, not floating point")
        elif isinstance(x, jax.Array) and x.is_deleted():
            bad.append(f"{key}: the array is deleted (donated to a jitted call?)")
    if missing or unexpected or bad:
        parts = [
            f"{what}: {', '.join(items[:5])}" + (f" (+{len(items) - 5} more)" * (len(items) > 5))
            for what, items in (("missing", missing), ("unexpected", unexpected), ("bad", bad))
            if items
        ]
        raise ValueError(f"new weights do not match the engine's model; {'; '.join(parts)}")
    pairs = []
    for key, (path, var) in zip(keys, want, strict=True):
        spec = var.get_value()
        x = flat[key]
        if x.dtype != spec.dtype:  # cast where it lies (a host array on the host), then placed
            x = x.astype(spec.dtype) if isinstance(x, jax.Array) else np.asarray(x, spec.dtype)
        pairs.append((path, var.replace(jax.device_put(x, spec.sharding))))
    return like.replace(state=nnx.from_flat_state(pairs))


class WeightsMixin:
    """`LLM`'s calls on its weights and device memory (`pagedjax.engine.LLM` inherits
    them; see the module docstring): `update_params`, `sleep`, `wake_up` and
    `reset_prefix_cache`. They work on the engine's `core` (`EngineCore`, which holds
    the params and the KV cache), `scheduler`, `block_manager` and `params`, and on the
    state `_init_weights` sets up; `_check_ready` refuses requests while it lacks a
    cache or weights.
    """

    def _init_weights(self, params: model_lib.Params) -> None:
        # What new weights must match (`update_params`), and whether `sleep` dropped the
        # weights (level 2) or the KV cache (any level) until new ones / `wake_up`.
        self._template = template(params)
        self._weights_dropped = False
        self._weights_offloaded = False  # (in host memory: sleep level 1)
        self._asleep = False

    def _check_ready(self) -> None:
        """RuntimeError unless the engine has a KV cache and weights to run a request."""
        if self._asleep:
            raise RuntimeError("the engine is asleep (sleep()): call wake_up() first")
        if self._weights_dropped:
            raise RuntimeError(
                "the engine's weights were dropped (sleep(level=2)): give new ones with "
                "update_params() first"
            )

    def update_params(self, params) -> None:
        """Replaces the model's weights with newly trained ones of the same model, for
        the requests that follow, with no reload and no recompile: a reinforcement-
        learning loop's policy update (`pagedjax.weight_sync`).

        Args:
          params: `model.Params`, an `nnx.State` (`nnx.state(model)`) or a {dotted
            path: array} dict (`model.params_to_flat`'s) of the same parameters and
            shapes. Floating-point arrays of another dtype are cast to the engine's
            (float32 master weights to a bfloat16 engine), and every array is placed
            as the engine's are (its device, or its sharding over the tensor-parallel
            mesh). Arrays already so are kept, not copied: a training step that
            donates them (`donate_argnums`) deletes the engine's weights with them;
            give the engine copies then.

        The prefix cache is cleared: its pages hold K/V that the old weights computed.
        After `sleep(level=2)` this is how the engine gets weights again.

        While the engine is paused (`pause_generation`), requests it kept may be
        unfinished: they go on with the new weights when `resume_generation` is called.
        Those that kept their K/V (`clear_cache=False`) attend to what the old weights
        computed, and none of their pages enters the prefix cache from then on.

        Raises:
          RuntimeError: requests are unfinished (queued, running or in flight) and the
            engine is not paused: they would mix the two models. Finish or abort them,
            or `pause_generation(mode="keep")` first.
          TypeError, ValueError: `params` is not one of those kinds, or a parameter is
            missing, unexpected, of another shape, not floating point or deleted (each
            named); the engine keeps the weights it had.
        """
        if not self.core.paused:
            self._check_idle("update_params")
        new = place_params(self._template, params)
        self.params = self.core.params = new
        self._weights_dropped = self._weights_offloaded = False
        self.block_manager.uncache()
        self.block_manager.stop_caching()  # (sequences a pause kept with their K/V)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt page (vLLM's `reset_prefix_cache`): True, or False
        with nothing done while requests are unfinished (their pages stay theirs)."""
        if self.scheduler.has_unfinished() or self.core.inflight is not None:
            return False
        self.block_manager.uncache()
        return True

    def sleep(self, level: int = 1) -> None:
        """Frees device memory for something else (a training step) until `wake_up`,
        as vLLM's sleep mode. Level 1 deletes the KV cache (the prefix cache is cleared
        with it) and moves the weights to host memory (`to_host`), which `wake_up`
        brings back; level 2 drops the weights instead, and `update_params` must give
        new ones before the next request. The weights' device memory is freed once
        nothing else holds their arrays: `LLM(params)` keeps the arrays it is given,
        so a caller that keeps them too keeps that memory in use.

        While the engine is paused (`pause_generation`), requests it kept may be queued,
        as long as none holds K/V (`clear_cache=True`, the default): they are recomputed
        after `wake_up` and `resume_generation`.

        Raises:
          RuntimeError: requests are unfinished (finish or abort them first), or, on a
            paused engine, hold K/V in the cache that sleep would delete.
          ValueError: `level` is not 1 or 2.
        """
        if type(level) is not int or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level=}")
        if not self.core.paused:
            self._check_idle("sleep")
        elif self.block_manager.stats().num_seqs:
            n = len(self.scheduler.running)
            raise RuntimeError(
                f"sleep deletes the KV cache, and {n} requests the pause kept hold K/V in "
                "it (pause_generation(clear_cache=False)): abort them, or pause with "
                "clear_cache=True, which recomputes them after wake_up()"
            )
        if not self._asleep:
            self.core.drop_cache()
            self._asleep = True
        if level == 2 and not self._weights_dropped:
            self.params = self.core.params = self._template  # (shapes only)
            self._weights_dropped = self._weights_offloaded = True
        elif not self._weights_dropped and not self._weights_offloaded:
            self.params = self.core.params = to_host(self.params)
            self._weights_offloaded = True

    def wake_up(self) -> None:
        """Ends `sleep`: a new, empty KV cache, and the weights back in device memory
        where `sleep(level=1)` moved them (nothing if the engine is not asleep). After
        `sleep(level=2)`, requests still need `update_params` first."""
        if not self._asleep:
            return
        if self._weights_offloaded and not self._weights_dropped:
            back = jax.tree.map(
                lambda x, t: jax.device_put(x, t.sharding), self.params, self._template
            )
            self.params = self.core.params = back
        self._weights_offloaded = False
        self.core.new_cache()
        self._asleep = False

    def pause_generation(
        self, mode: str = "abort", clear_cache: bool = True, *, on_token=None
    ) -> list[RequestOutput]:
        """Stops generating until `resume_generation`, so that the weights can change in
        the middle of requests (`update_params`, `sleep`): vLLM's `pause_generation`
        for an asynchronous reinforcement-learning loop, whose rollouts run across
        policy updates.

        First the step in flight, if any, completes. Then, by `mode`:

        - "abort" (vLLM's default): every unfinished request is aborted; its output,
          finished with "abort", holds what it generated.
        - "wait": steps run until every unfinished request has finished.
        - "keep": unfinished requests stay, and go on after `resume_generation`.

        While paused, `step()` does nothing and returns [] (outputs carried over from a
        failed step aside); `add_request` queues, `abort` aborts; `generate`, `chat`
        and `beam_search` raise. Pausing a paused engine pauses it again by `mode`.

        Args:
          mode: "abort", "wait" or "keep", as above.
          clear_cache: True: the prefix cache is cleared, and requests kept running
            give their pages back (preempted): after the pause each is recomputed from
            its prompt and the tokens it generated, so all its K/V comes from the
            weights of that time. False: kept requests keep their K/V, which later
            tokens attend to (stale if `update_params` changes the weights; vLLM's
            partial rollouts), and the prefix cache stays (`update_params` clears it).
          on_token: as `step`'s, for the tokens the pause applies (of the step in
            flight, and with "wait" of the steps it runs).

        Returns:
          The outputs `step()` would have returned meanwhile: of the step in flight,
          the aborted requests' ("abort"), or the finished ones' ("wait").

        Raises:
          ValueError: a bad `mode`; TypeError: `clear_cache` not a bool; RuntimeError:
            "wait" on an engine that cannot run its requests (asleep, or without
            weights). Nothing changed then.
        """
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f'mode must be "abort", "wait" or "keep", got {mode!r}')
        if not isinstance(clear_cache, bool):
            raise TypeError(f"clear_cache must be a bool, got {clear_cache!r}")
        if mode == "wait" and self.scheduler.has_unfinished():
            self._check_ready()  # (asleep with the requests a pause kept: nothing runs)
        self.core.paused = False
        with self._run_clock():
            outs, self._unclaimed = self._unclaimed + self.core.drain(on_token), []
        if mode == "wait":
            while self.has_unfinished_requests():
                outs += self.step(on_token=on_token)
        elif mode == "abort":
            groups = [*self.scheduler.running, *self.scheduler.waiting]
            outs += [self.abort(i) for i in dict.fromkeys(g.request_id for g in groups)]
        elif clear_cache and self.scheduler.running:
            self.core.requeue_all()
        self.core.paused = True
        if clear_cache:
            self.block_manager.uncache()
        return outs

    def resume_generation(self) -> None:
        """Ends `pause_generation`: the next `step()` schedules the requests it kept and
        any queued since (nothing if the engine is not paused).

        Raises:
          RuntimeError: the engine is asleep, or without weights (`sleep(level=2)`):
            `wake_up()` or `update_params()` first. It stays paused then.
        """
        if self.core.paused:
            self._check_ready()
        self.core.paused = False

    def is_paused(self) -> bool:
        """Whether `pause_generation` paused the engine (until `resume_generation`)."""
        return self.core.paused

    def _check_idle(self, what: str) -> None:
        if self.scheduler.has_unfinished() or self.core.inflight is not None:
            n = len(self.scheduler.running) + len(self.scheduler.waiting)
            raise RuntimeError(
                f"{what} needs an engine with no unfinished request; {n} are queued or "
                'running: finish or abort them first, or pause_generation(mode="keep")'
            )
