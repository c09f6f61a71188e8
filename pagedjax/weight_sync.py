"""New weights for a running engine: the policy update of a reinforcement-learning loop.

An RL loop alternates generating rollouts with the current policy and training it:

    llm = LLM(params)                       # the inference copy (e.g. bfloat16)
    for it in range(steps):
        outs = llm.generate(prompts, sp)    # rollouts
        llm.sleep()                         # KV cache deleted, weights to host memory
        state = train_step(state, outs)     # float32 master weights, sharded as training likes
        llm.update_params(state.params)     # no reload, no recompile
        llm.wake_up()                       # a new KV cache

`wake_up(tags=...)` wakes one part at a time, as vLLM's: `wake_up(tags=["weights"])`,
new weights, then `wake_up(tags=["kv_cache"])` keeps the KV cache out of device memory
while the weights change (verl's order). Requests need both awake (`is_sleeping()`).

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

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax import model as model_lib
from pagedjax import weights as weights_lib
from pagedjax.config import is_int
from pagedjax.request import RequestOutput

__all__ = ["WeightsMixin", "nonfinite", "place_params", "template", "to_host"]

# What `sleep` puts to sleep and `wake_up(tags)` wakes, in the order it wakes them.
SLEEP_TAGS = ("weights", "kv_cache")
_HOST_MEMORY = ("pinned_host", "unpinned_host")  # jax arrays' memory kinds in host memory


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
    loop's `nnx.state(model)`, of `Variable`s or of arrays), such a dict already, or a
    nested dict (`nnx.to_pure_dict`'s, which Flax has `nnx.State` give way to, and a
    restored checkpoint's)."""
    if isinstance(new, model_lib.Params):
        return model_lib.params_to_flat(new)
    if isinstance(new, nnx.State):
        return {
            ".".join(map(str, p)): v.get_value() if isinstance(v, nnx.Variable) else v
            for p, v in nnx.to_flat_state(new)
        }
    if isinstance(new, Mapping):
        return _flat_dict(new, "")
    raise TypeError(
        "new weights must be pagedjax.model.Params, an nnx.State or a {dotted path: array} "
        f"dict (model.params_to_flat's), got {type(new).__name__}"
    )


def _flat_dict(tree: Mapping, prefix: str) -> dict:
    """{dotted path: array} of a dict of dotted paths (`prefix` "") or of names and
    nested dicts (their keys below the top may be ints: `nnx.to_pure_dict`'s layers),
    whose values are arrays or `Variable`s (their values taken)."""
    flat = {}
    for k, v in tree.items():
        if not isinstance(k, str) and not (prefix and is_int(k)):
            raise TypeError(f"a weights dict's keys must be dotted paths (str), got {k!r}")
        if isinstance(v, Mapping):
            flat |= _flat_dict(v, f"{prefix}{k}.")
        else:
            flat[f"{prefix}{k}"] = v.get_value() if isinstance(v, nnx.Variable) else v
    return flat


def _f16_overflow(x) -> tuple[int, float] | None:
    """(count, largest |x|) of the finite values of `x` that float16 makes inf, or None
    if there are none: loading a checkpoint into a float16 model refuses them too."""
    if isinstance(x, jax.Array) and x.sharding.memory_kind not in _HOST_MEMORY:
        count, largest = weights_lib._f16_overflow(x)  # (where `x` lies)
    else:  # (a program fails on an array in host memory, as `to_host` puts them: numpy)
        x = np.asarray(x)
        with np.errstate(over="ignore"):
            over = np.isfinite(x) & np.isinf(x.astype(np.float16))
        count, largest = over.sum(), np.abs(x[over]).max(initial=0)
    return (int(count), float(largest)) if count else None


def place_params(like: model_lib.Params, new) -> model_lib.Params:
    """`new` weights as `Params` shaped, typed and placed as `like` (a `Params` or its
    `template`), with `like`'s structure, config and mesh.

    Arrays already in the engine's dtype and placement are kept, not copied (as
    `LLM(params)` keeps them): a training step that donates them deletes the engine's
    weights too.

    Raises:
      TypeError: `new` is none of the accepted kinds.
      ValueError: a parameter missing, unexpected (HF tensor names among them: said
        so), of another shape, not floating point, not an array (a `ShapeDtypeStruct`,
        as a dropped engine's `params`), deleted (donated), or with finite values that
        a float16 engine's dtype would make inf (as loading a checkpoint refuses them),
        naming each (all at once).
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
        elif not isinstance(x, jax.Array) and not hasattr(x, "__array__"):
            bad.append(f"{key}: a {type(x).__name__}, which holds no values")
        elif isinstance(x, jax.Array) and x.is_deleted():
            bad.append(f"{key}: the array is deleted (donated to a jitted call?)")
        elif spec.dtype == np.float16 and dtype != np.float16 and (n := _f16_overflow(x)):
            bad.append(f"{key}: {n[0]} values beyond float16's range, up to |x| = {n[1]:.4g}")
    if missing or unexpected or bad:
        parts = [
            f"{what}: {', '.join(items[:5])}" + (f" (+{len(items) - 5} more)" * (len(items) > 5))
            for what, items in (("missing", missing), ("unexpected", unexpected), ("bad", bad))
            if items
        ]
        hf = [k for k in unexpected if weights_lib.hf_to_path(k) is not None]
        if hf:
            parts.append(
                f"{hf[0]!r} is an HF tensor name: give the model's dotted paths "
                "(pagedjax.weights.hf_to_path maps a name, and says which to transpose)"
            )
        raise ValueError(f"new weights do not match the engine's model; {'; '.join(parts)}")
    pairs = []
    for key, (path, var) in zip(keys, want, strict=True):
        spec = var.get_value()
        x = flat[key]
        # Cast where it lies (a host array on the host), then placed. A weak-typed array
        # (`jnp.full(shape, 0.0)`'s) is another input type to the jitted steps: it would
        # compile new programs, so it loses its weak type (`astype`) even in our dtype.
        if x.dtype != spec.dtype or getattr(x, "weak_type", False):
            x = x.astype(spec.dtype) if isinstance(x, jax.Array) else np.asarray(x, spec.dtype)
        pairs.append((path, var.replace(jax.device_put(x, spec.sharding))))
    return like.replace(state=nnx.from_flat_state(pairs))


def nonfinite(params: model_lib.Params) -> list[str]:
    """Each array of `params` that holds NaN or inf, as "path: n of size values NaN or
    inf", counted where the arrays lie (one device-to-host transfer of the counts)."""
    flat = model_lib.params_to_flat(params)
    counts = jax.device_get({k: jnp.count_nonzero(~jnp.isfinite(x)) for k, x in flat.items()})
    return [f"{k}: {int(n)} of {flat[k].size} values NaN or inf" for k, n in counts.items() if n]


def _tags(tags) -> list:
    """`wake_up`'s tags, checked: a list of `SLEEP_TAGS` (None: all)."""
    if tags is None:
        return list(SLEEP_TAGS)
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):
        raise TypeError(
            f"tags must be a list of 'weights' and/or 'kv_cache', or None, got {tags!r}"
        )
    tags = list(tags)
    bad = [t for t in tags if t not in SLEEP_TAGS]
    if bad:
        hint = ""
        if "scheduling" in bad:  # (vLLM's sleep(level=0) pauses scheduling)
            hint = "; to resume after pause_generation(), call resume_generation()"
        raise ValueError(
            f"unknown wake_up tag {', '.join(map(repr, bad))}: the tags are "
            f"{' and '.join(map(repr, SLEEP_TAGS))}{hint}"
        )
    return tags


class WeightsMixin:
    """`LLM`'s calls on its weights and device memory (`pagedjax.engine.LLM` inherits
    them; see the module docstring): `update_params`, `sleep`, `wake_up`, `is_sleeping`,
    `reset_prefix_cache` and the pause calls. They work on the engine's `core`
    (`EngineCore`, which holds the params and the KV cache), `scheduler`,
    `block_manager` and `params`, and on the state `_init_weights` sets up;
    `_check_ready` refuses requests while it lacks a cache or weights.
    """

    def _init_weights(self, params: model_lib.Params) -> None:
        # What new weights must match (`update_params`); what `sleep` put to sleep
        # (`SLEEP_TAGS`: "weights" in host memory, or dropped; "kv_cache" deleted) until
        # `wake_up`; and whether `sleep(level=2)` dropped the weights until new ones.
        self._template = template(params)
        self._sleeping: set[str] = set()
        self._weights_dropped = False

    def _check_ready(self) -> None:
        """RuntimeError, naming what is missing, unless the engine has a KV cache and
        weights to run a request."""
        asleep = [t for t in SLEEP_TAGS if t in self._sleeping]
        if len(asleep) == len(SLEEP_TAGS):
            raise RuntimeError("the engine is asleep (sleep()): call wake_up() first")
        if asleep == ["kv_cache"]:
            raise RuntimeError(
                "the engine's KV cache is still asleep (only its weights woke up): call "
                "wake_up(tags=['kv_cache']) or wake_up() first"
            )
        if asleep == ["weights"] and not self._weights_dropped:
            raise RuntimeError(
                "the engine's weights are still asleep, in host memory (only its KV cache "
                "woke up): call wake_up(tags=['weights']) or wake_up() first"
            )
        if self._weights_dropped:
            raise RuntimeError(
                "the engine's weights were dropped (sleep(level=2)): give new ones with "
                "update_params() first"
            )

    def is_sleeping(self) -> bool:
        """Whether anything `sleep` put to sleep still sleeps: True until `wake_up` woke
        both the weights and the KV cache (vLLM's `is_sleeping`). New weights
        (`update_params`) go to device memory, so they wake the weights."""
        return bool(self._sleeping)

    def update_params(self, params, *, check_finite: bool = False) -> None:
        """Replaces the model's weights with newly trained ones of the same model, for
        the requests that follow, with no reload and no recompile: a reinforcement-
        learning loop's policy update (`pagedjax.weight_sync`).

        Args:
          params: `model.Params`, an `nnx.State` (`nnx.state(model)`), a {dotted
            path: array} dict (`model.params_to_flat`'s) or a nested dict
            (`nnx.to_pure_dict`'s) of the same parameters and shapes. Floating-point
            arrays of another dtype are cast to the engine's (float32 master weights
            to a bfloat16 engine), and every array is placed as the engine's are (its
            device, or its sharding over the tensor-parallel mesh). Arrays already so
            are kept, not copied: a training step that donates them (`donate_argnums`)
            deletes the engine's weights with them; give the engine copies then.
          check_finite: also refuse weights holding NaN or inf (a diverged training
            step's), counted on the device once they are placed (one pass over the
            weights). False: taken as they are, as vLLM and loading a checkpoint do.

        The prefix cache is cleared: its pages hold K/V that the old weights computed.
        After `sleep(level=2)` this is how the engine gets weights again. While the
        engine sleeps, the new weights go to device memory all the same: the weights are
        awake from then on (`wake_up(tags=["weights"])` first is not needed), the KV
        cache still asleep.

        While the engine is paused (`pause_generation`), requests it kept may be
        unfinished: they go on with the new weights when `resume_generation` is called.
        Those that kept their K/V (`clear_cache=False`) attend to what the old weights
        computed, and none of their pages enters the prefix cache from then on.

        Raises:
          RuntimeError: requests are unfinished (queued, running or in flight) and the
            engine is not paused: they would mix the two models. Finish or abort them,
            or `pause_generation(mode="keep")` first. Also inside a step (from an
            `on_token` callback), paused or not.
          TypeError, ValueError: `params` is not one of those kinds, or a parameter is
            missing, unexpected, of another shape, not floating point, not an array,
            deleted, or beyond float16's range in a float16 engine (each named,
            `place_params`), or with `check_finite` holds NaN or inf (each named, with
            how many); the engine keeps the weights it had, and its prefix cache.
        """
        if not isinstance(check_finite, (bool, np.bool_)):
            raise TypeError(f"check_finite must be a bool, got {check_finite=}")
        self.core.check_outside_step("update_params()")  # (paused or not)
        if not self.core.paused:
            self._check_idle("update_params")
        new = place_params(self._template, params)
        if check_finite and (bad := nonfinite(new)):
            more = f" (+{len(bad) - 5} more)" * (len(bad) > 5)
            raise ValueError(
                f"new weights hold NaN or inf: {', '.join(bad[:5])}{more}; the engine keeps "
                "the weights it had"
            )
        self.params = self.core.params = new
        self._weights_dropped = False
        self._sleeping.discard("weights")  # (placed in device memory, as the programs expect)
        self.block_manager.uncache()
        self.block_manager.stop_caching()  # (sequences a pause kept with their K/V)

    def reset_prefix_cache(
        self,
        reset_running_requests: bool = False,
        reset_connector: bool = False,
        *,
        on_token=None,
    ) -> bool:
        """Forgets every cached prompt page (vLLM's `reset_prefix_cache`), as new
        weights need (`update_params` does it itself).

        Args:
          reset_running_requests: False: nothing is done while requests hold pages
            (running, or a step in flight): their pages stay theirs, and False is
            returned. True (vLLM's, to reset in the middle of requests): the step in
            flight completes first (the next `step()` returns its outputs, partial
            ones too, unless `LLM.abort` ends their request first), then every running
            request gives its pages back (preempted, as `pause_generation(mode="keep")`
            does) and waits to be recomputed from its prompt and the tokens it
            generated, so none of its K/V outlives the reset.
          reset_connector: vLLM's, for a KV connector's cache; pagedjax has no
            connector, so there is nothing more to reset.
          on_token: as `step`'s, for the tokens of the step in flight that
            `reset_running_requests=True` completes.

        Returns:
          Whether the prefix cache was reset.

        Raises:
          TypeError: a flag that is not a bool; RuntimeError: `reset_running_requests`
            inside a step (from an `on_token` callback). Nothing changed then.
        """
        flags = dict(reset_running_requests=reset_running_requests, reset_connector=reset_connector)
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if reset_running_requests:
            self.core.check_outside_step("reset_prefix_cache(reset_running_requests=True)")
            with self._run_clock():
                self._claim(self.core.drain(on_token))  # (the next step() returns them)
            if self.scheduler.running:
                self.core.requeue_all()
        elif self.block_manager.stats().num_seqs or self.core.inflight is not None:
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
        so a caller that keeps them too keeps that memory in use. Whatever a partial
        `wake_up(tags=...)` woke goes back to sleep.

        While the engine is paused (`pause_generation`), requests it kept may be queued,
        as long as none holds K/V (`clear_cache=True`, the default): they are recomputed
        after `wake_up` and `resume_generation`.

        Raises:
          RuntimeError: requests are unfinished (finish or abort them first), or, on a
            paused engine, hold K/V in the cache that sleep would delete; or called
            inside a step (from an `on_token` callback).
          ValueError: `level` is not 1 or 2.
        """
        if not is_int(level) or level not in (1, 2):
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
        # The weights' host copy first: if it fails (out of pinned host memory), nothing
        # changed, the KV cache included.
        host = None
        if level == 1 and "weights" not in self._sleeping and not self._weights_dropped:
            host = to_host(self.params)
        if "kv_cache" not in self._sleeping:
            self.core.drop_cache()
            self._sleeping.add("kv_cache")
        if level == 2 and not self._weights_dropped:
            self.params = self.core.params = self._template  # (shapes only)
            self._weights_dropped = True
        elif host is not None:
            self.params = self.core.params = host
        self._sleeping.add("weights")

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Ends `sleep`, for all of it or the parts `tags` names (vLLM's `wake_up`):

        - "weights": the weights go back to device memory, where `sleep(level=1)` moved
          them from (after `sleep(level=2)` there are none: `update_params` gives new
          ones, which go to device memory and wake the weights by themselves);
        - "kv_cache": a new, empty KV cache (and the LoRA slots).

        To keep the KV cache out of device memory while the weights change (verl's
        order): `wake_up(tags=["weights"])`, `update_params(new)`, then
        `wake_up(tags=["kv_cache"])`. Requests need both awake: until then `generate`,
        `add_request` and `resume_generation` raise, naming what still sleeps, and
        `is_sleeping()` is True.

        Args:
          tags: "weights" and/or "kv_cache" (woken in that order); None: both. Parts
            already awake are skipped (vLLM warns and wakes nothing then), so on an
            engine that is not asleep this does nothing.

        Raises:
          ValueError: an unknown tag (each named); TypeError: `tags` is a string or not
            iterable. Nothing changed then.
        """
        given = _tags(tags)
        wake = [t for t in SLEEP_TAGS if t in given and t in self._sleeping]
        if "weights" in wake:
            if not self._weights_dropped:
                back = jax.tree.map(
                    lambda x, t: jax.device_put(x, t.sharding), self.params, self._template
                )
                self.params = self.core.params = back
            self._sleeping.discard("weights")
        if "kv_cache" in wake:
            try:
                self.core.new_cache()
            except BaseException:
                # (out of device memory half way, say for the LoRA slots: none of the new
                # cache stays, so that sleep() frees it all and a retry needs no room for two)
                self.core.drop_cache()
                raise
            self._sleeping.discard("kv_cache")

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
            weights), or called inside a step (from an `on_token` callback). Nothing
            changed then.
          Whatever the completion of the step in flight, or a step "wait" runs, raises
          (an `on_token` callback's exception, a device error, KeyboardInterrupt): it
          propagates, with a note, once the engine recovered as `step` does (every
          request aborted, no step in flight). The engine is paused all the same, after
          anything that raises past the checks above (with `clear_cache`, the prefix
          cache cleared), as vLLM's pause, which sets its flag before it aborts or
          waits: the caller may go on to `update_params` and `resume_generation`. The
          outputs the pause had collected (those it would have returned) are returned
          by the next `step()`, not lost.
        """
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f'mode must be "abort", "wait" or "keep", got {mode!r}')
        if not isinstance(clear_cache, bool):
            raise TypeError(f"clear_cache must be a bool, got {clear_cache!r}")
        self.core.check_outside_step("pause_generation()")
        if mode == "wait" and self.scheduler.has_unfinished():
            self._check_ready()  # (asleep with the requests a pause kept: nothing runs)
        self.core.paused = False  # ("wait" steps; a paused engine's steps do nothing)
        outs: list[RequestOutput] = []
        try:
            with self._run_clock():
                outs, self._unclaimed = self._unclaimed + self.core.drain(on_token), []
            if mode == "wait":
                while self.has_unfinished_requests():
                    outs += self.step(on_token=on_token)
            elif mode == "abort":
                groups = [*self.scheduler.running, *self.scheduler.waiting]
                for i in dict.fromkeys(g.request_id for g in groups):
                    outs.append(self.abort(i))
            elif clear_cache and self.scheduler.running:
                self.core.requeue_all()
        except BaseException as e:
            self._unclaimed = outs + self._unclaimed  # (the next step() returns them)
            e.add_note(
                "pagedjax: pause_generation() failed; the engine is paused all the same "
                "(resume_generation() goes on), and the next step() returns the outputs "
                "it had collected"
            )
            raise
        finally:
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
        """RuntimeError unless no request is unfinished. A step still in flight whose
        requests were all aborted since (`abort` of the last ones) holds nothing anyone
        waits for: it is completed here rather than refused. Inside a step (an
        `on_token` callback) the engine is never idle: RuntimeError."""
        self.core.check_outside_step(f"{what}()")
        self.core.drain_orphaned()
        if not self.scheduler.has_unfinished() and self.core.inflight is None:
            return
        n = len(self.scheduler.running) + len(self.scheduler.waiting)
        raise RuntimeError(
            f"{what} needs an engine with no unfinished request; {n} are queued or "
            'running: finish or abort them first, or pause_generation(mode="keep")'
        )
