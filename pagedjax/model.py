"""Llama-family decoder (Llama 2/3/3.1/3.2, Qwen2, Qwen3, Mistral) in Flax NNX, dense and paged.

Two forward passes share one set of modules:

* `forward(params, tokens)` / `Llama.__call__`: dense causal attention over whole
  sequences, no cache. The oracle in tests and the training forward (jit- and
  grad-friendly: `jax.grad(lambda s: loss(forward(Params(g, s, cfg), x)))`).
* `forward_paged(params, cache, ...)`: one engine step. Per layer: QKV, RoPE at each
  token's own position, this step's K/V written into pages through the slot mapping,
  then paged attention through `pallas_kernels` (`ragged_paged_attention` for mixed
  prefill/decode batches, `paged_decode_attention` when every sequence brings one
  token), then the MLP. Only the rows in `logits_indices` reach the LM head.

Family options (`ModelConfig`): `qkv_bias` (Qwen2; with `o_bias` too, HF's
`attention_bias` in Llama and Qwen3); `qk_norm` (Qwen3: an RMSNorm over
each query and key head, weight `[D]`, after the projections and before RoPE);
`sliding_window` (Mistral-7B-v0.1: every layer attends only to the last W positions,
itself included; both forwards mask with it, and the paged one passes it to the
kernels. The engine releases pages that fall out of the window; their page-table
entries then name the padding page, which the window masks); `rope_scaling` (linear,
llama3 or yarn, as HF computes them: `rope_frequencies`, `rope_attention_factor`).

Tensor parallelism: `pagedjax.sharding.shard_params` places the parameters on a
"tp" mesh and records the mesh in `Params.mesh`; `forward_paged` then runs each
layer's cache write and attention per shard under `jax.shard_map` and lets XLA
partition the rest (two all-reduces per layer; see `pagedjax.sharding`). Without a
mesh the step is the single-device program, unchanged.

Hot path: `nnx.jit` re-walks the module graph in Python on every call, so the model
is split once, `params = split_model(model)` (a `Params` pytree: the `GraphDef` as
static metadata, the `nnx.State` as data), and `jax.jit` is applied to pure
functions of `params` that `nnx.merge` it back inside the trace (see
`pagedjax.decode`). `Params` keeps the state flattened, so a call flattens a tuple
of arrays rather than walking the `nnx.State` (see `Params`).

Parameter paths (dotted keys of `params_to_flat`; `nnx.split` state paths), with
`E` hidden, `I` intermediate, `H`/`K` query/kv heads, `D` head dim, `V` vocab. Linear
kernels are stored `[in, out]` (HF's `weight` transposed); q/k/v outputs are
head-major (`[..., H * D]` reshapes to `[..., H, D]`, as in HF):

    embed_tokens.embedding                      [V, E]        HF model.embed_tokens.weight
    layers.{i}.input_layernorm.scale            [E]           ...layers.{i}.input_layernorm.weight
    layers.{i}.self_attn.q_proj.kernel          [E, H * D]    ...self_attn.q_proj.weight.T
    layers.{i}.self_attn.q_proj.bias            [H * D]       ...self_attn.q_proj.bias (qkv_bias)
    layers.{i}.self_attn.k_proj.kernel          [E, K * D]    ...self_attn.k_proj.weight.T
    layers.{i}.self_attn.k_proj.bias            [K * D]       ...self_attn.k_proj.bias (qkv_bias)
    layers.{i}.self_attn.v_proj.kernel          [E, K * D]    ...self_attn.v_proj.weight.T
    layers.{i}.self_attn.v_proj.bias            [K * D]       ...self_attn.v_proj.bias (qkv_bias)
    layers.{i}.self_attn.q_norm.scale           [D]           ...self_attn.q_norm.weight (qk_norm)
    layers.{i}.self_attn.k_norm.scale           [D]           ...self_attn.k_norm.weight (qk_norm)
    layers.{i}.self_attn.o_proj.kernel          [H * D, E]    ...self_attn.o_proj.weight.T
    layers.{i}.self_attn.o_proj.bias            [E]           ...self_attn.o_proj.bias (o_bias)
    layers.{i}.post_attention_layernorm.scale   [E]           ...post_attention_layernorm.weight
    layers.{i}.mlp.gate_proj.kernel             [E, I]        ...mlp.gate_proj.weight.T
    layers.{i}.mlp.up_proj.kernel               [E, I]        ...mlp.up_proj.weight.T
    layers.{i}.mlp.down_proj.kernel             [I, E]        ...mlp.down_proj.weight.T
    norm.scale                                  [E]           model.norm.weight
    lm_head.kernel                              [E, V]        lm_head.weight.T (untied only)

With `tie_embeddings` there is no `lm_head`; logits are `h @ embed_tokens.embedding.T`.
All parameters are in `cfg.dtype`; logits are returned in float32.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import pallas_kernels
from pagedjax import cache as cache_lib
from pagedjax import sharding as sharding_lib
from pagedjax.config import ModelConfig
from pagedjax.rope import apply_rope, rope_attention_factor, rope_frequencies

_MASKED = -1e30  # finite, so the dense forward's softmax has clean gradients


class RMSNorm(nnx.Module):
    """RMSNorm as in HF Llama: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * y.astype(x.dtype)


def _dot_precision(dtype):
    """HIGHEST for float32 operands, else None (XLA's DEFAULT). DEFAULT runs a float32 dot
    in TF32 on recent GPUs (10-bit mantissa, ~1e-3 relative) and in one bfloat16 pass on
    TPUs, where HF's float32 model computes in float32 (torch's matmuls do not use TF32 by
    default) and so do our float32 kernels; bfloat16 operands lose nothing to DEFAULT."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _linear(n_in, n_out, cfg, rngs, bias=False):
    dt = cfg.jnp_dtype
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=bias,
        dtype=dt,
        param_dtype=dt,
        precision=_dot_precision(dt),
        rngs=rngs,
    )


def _project(linear, name: str, x, lora):
    """`linear(x)`, plus `lora(name, x)` (the LoRA update of module `name`) if given."""
    y = linear(x)
    return y if lora is None else y + lora(name, x)


class Attention(nnx.Module):
    """GQA projections and RoPE; the attention itself is chosen by the caller."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _linear(e, h * d, cfg, rngs, bias=cfg.qkv_bias)
        self.k_proj = _linear(e, k * d, cfg, rngs, bias=cfg.qkv_bias)
        self.v_proj = _linear(e, k * d, cfg, rngs, bias=cfg.qkv_bias)
        self.o_proj = _linear(h * d, e, cfg, rngs, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm over D, shared by all heads
            self.q_norm = RMSNorm(d, cfg.norm_eps, cfg.jnp_dtype)
            self.k_norm = RMSNorm(d, cfg.norm_eps, cfg.jnp_dtype)
        self.qk_norm = cfg.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, d
        self.rope_scale = rope_attention_factor(cfg)  # static: a float in the graphdef

    def qkv(self, x, positions, inv_freq, lora=None):
        """x: [..., T, E], positions: [..., T] -> q [..., T, H, D], k and v [..., T, K, D];
        q and k rotated by cos and sin times `rope_scale` (HF's: so is the cached k).
        `lora(module_name, x)`: an update added to each projection (`_project`)."""
        lead = x.shape[:-1]
        q = _project(self.q_proj, "q_proj", x, lora).reshape(*lead, self.num_heads, self.head_dim)
        k = _project(self.k_proj, "k_proj", x, lora)
        v = _project(self.v_proj, "v_proj", x, lora)
        k = k.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = partial(apply_rope, positions=positions, inv_freq=inv_freq, scale=self.rope_scale)
        return rope(q), rope(k), v

    def out(self, o, lora=None):
        """o: [..., T, H, D] -> [..., T, E]."""
        o = o.reshape(*o.shape[:-2], self.num_heads * self.head_dim)
        return _project(self.o_proj, "o_proj", o, lora)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(e, i, cfg, rngs)
        self.up_proj = _linear(e, i, cfg, rngs)
        self.down_proj = _linear(i, e, cfg, rngs)

    def __call__(self, x, lora=None):
        gate = _project(self.gate_proj, "gate_proj", x, lora)
        h = jax.nn.silu(gate) * _project(self.up_proj, "up_proj", x, lora)
        return _project(self.down_proj, "down_proj", h, lora)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.jnp_dtype)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.jnp_dtype)
        self.mlp = MLP(cfg, rngs=rngs)


class Llama(nnx.Module):
    """A Llama-family causal LM. `cfg` is kept as static module metadata."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = cfg.jnp_dtype
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dt, param_dtype=dt, rngs=rngs
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dt)
        self.lm_head = (
            None if cfg.tie_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, cfg, rngs)
        )

    def logits(self, h):
        """Final norm and LM head: h [..., E] -> [..., V] float32."""
        h = self.norm(h)
        w = self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
        precision = _dot_precision(h.dtype)
        return jnp.dot(h, w, precision=precision, preferred_element_type=jnp.float32)

    def __call__(self, tokens, *, kv_dtype=None):
        """Dense causal forward with no cache: tokens [B, T] int -> logits [B, T, V] float32.

        `kv_dtype` rounds K and V through a cache storage dtype (e.g. FP8) before
        attention, as a paged step reading them from such a cache sees them.
        """
        inv_freq = rope_frequencies(self.cfg)
        positions = jnp.arange(tokens.shape[-1])
        x = self.embed_tokens(tokens)  # [B, T, E]
        for layer in self.layers:
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), positions, inv_freq)
            if kv_dtype is not None:
                k = cache_lib.to_storage(k, kv_dtype).astype(k.dtype)
                v = cache_lib.to_storage(v, kv_dtype).astype(v.dtype)
            o = dense_causal_attention(q, k, v, sliding_window=self.cfg.sliding_window)
            x = x + attn.out(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.logits(x)

    def paged(
        self,
        cache: cache_lib.PagedKVCache,
        token_ids,
        positions,
        slot_mapping,
        page_table,
        context_lens,
        query_start_loc,
        logits_indices,
        *,
        decode: bool = False,
        backend: str = "auto",
        interpret: bool = False,
        mesh: Mesh | None = None,
        lora=None,
        lora_slots=None,
        return_hidden: bool = False,
    ):
        """One paged step; see `forward_paged` for the arguments (`mesh`: `Params.mesh`)."""
        inv_freq = rope_frequencies(self.cfg)
        attend = partial(
            _write_and_attend,
            decode=decode,
            sliding_window=self.cfg.sliding_window,
            backend=backend,
            interpret=interpret,
        )
        if mesh is not None:  # per shard: this device's heads and its slice of every page
            attend = sharding_lib.shard_attention(attend, mesh, self.cfg.num_kv_heads)
        meta = (slot_mapping, page_table, context_lens, query_start_loc)
        new_k, new_v = [], []
        x = self.embed_tokens(token_ids)  # [T, E]
        mask = None if lora is None else lora.mask(lora_slots)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            delta = None if lora is None else partial(lora.delta, i, mask)
            q, k, v = attn.qkv(layer.input_layernorm(x), positions, inv_freq, delta)
            o, k_pages, v_pages = attend(q, k, v, *cache.layer(i), *meta)
            new_k.append(k_pages)
            new_v.append(v_pages)
            x = x + attn.out(o.astype(x.dtype), delta)
            x = x + layer.mlp(layer.post_attention_layernorm(x), delta)
        cache = cache_lib.PagedKVCache(k=tuple(new_k), v=tuple(new_v))
        logits = self.head(x[logits_indices], mesh)
        return (logits, cache, x) if return_hidden else (logits, cache)

    def head(self, h, mesh: Mesh | None = None):
        """Whole float32 logits [N, V] of final hidden rows h [N, E] (before the final
        norm), on every device under `mesh` (sampling needs whole rows: one all-gather)."""
        logits = self.logits(h)
        if mesh is not None:
            logits = sharding_lib.gather_logits(logits, mesh)
        return logits


def _write_and_attend(
    q,
    k,
    v,
    k_pages,
    v_pages,
    slot_mapping,
    page_table,
    context_lens,
    query_start_loc,
    *,
    decode,
    sliding_window,
    backend,
    interpret,
):
    """One layer's cache write then paged attention: q [T, H, D], k/v [T, K, D], pools
    [K, P, S, D] (one device's shard of each under tensor parallelism) -> (o [T, H, D],
    k_pages, v_pages)."""
    k_pages, v_pages = cache_lib.write_layer(k_pages, v_pages, k, v, slot_mapping)
    if not cache_lib.is_fp8(k_pages.dtype):  # FP8 pages: q keeps its dtype, tiles upcast
        q = q.astype(k_pages.dtype)
    if decode:
        o = pallas_kernels.paged_decode_attention(
            q,
            k_pages,
            v_pages,
            context_lens,
            page_table,
            sliding_window=sliding_window,
            backend=backend,
            interpret=interpret,
        )
    else:
        o = pallas_kernels.ragged_paged_attention(
            q,
            k_pages,
            v_pages,
            page_table,
            context_lens,
            query_start_loc,
            sliding_window=sliding_window,
            backend=backend,
            interpret=interpret,
        )
    return o, k_pages, v_pages


def dense_causal_attention(q, k, v, *, sliding_window: int | None = None):
    """Causal GQA attention over whole sequences, float32 inside.

    Args:
      q: [B, T, H, D]
      k: [B, T, K, D]
      v: [B, T, K, D]
      sliding_window: W: position p sees only keys j with p - W < j <= p.

    Returns:
      [B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    kh = k.shape[2]
    # bf16 q, k, v: exact in any pass (p's TF32 rounding is finer than HF's bf16 p).
    precision = _dot_precision(q.dtype)
    qg = q.reshape(b, t, kh, h // kh, d).astype(jnp.float32)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32), precision=precision)
    s = s * d**-0.5
    pos = jnp.arange(t)
    causal = pos[None, :] <= pos[:, None]  # [T, T] (query, key)
    if sliding_window is not None:
        causal &= pos[None, :] > pos[:, None] - sliding_window
    p = jax.nn.softmax(jnp.where(causal, s, _MASKED), axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32), precision=precision)
    return o.reshape(b, t, h, d).astype(q.dtype)


@jax.tree_util.register_pytree_node_class
class Params:
    """A split model: the pytree that jitted functions take instead of the module.

    `Params(graphdef, state, config, mesh=None)`. The state is flattened once, here,
    and kept as a tuple of arrays: an `nnx.State` flattens through a Python callback
    per `Variable` (0.27 ms for Llama-3-8B's 291 arrays on our CPU), which every jitted
    step would pay on the host, and a jitted step's call took ~2 ms longer with it
    (BENCHMARKS.md, "Host overhead"); a `Params` flattens with one callback. Treat it as
    immutable: `state` returns a new `nnx.State` (changing it changes nothing here);
    build a new `Params` (or `replace`) to change weights.

    Attributes:
      graphdef: the module structure (static; hashable).
      state: the `nnx.State` of all parameters (the only arrays), rebuilt on access.
      config: the model's config (static).
      mesh: the tensor-parallel mesh the state is sharded over (static; None: one
        device). Set by `pagedjax.sharding.shard_params`.
    """

    __slots__ = ("graphdef", "config", "mesh", "_leaves", "_treedef")

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        state: nnx.State,
        config: ModelConfig,
        mesh: Mesh | None = None,
    ):
        leaves, treedef = jax.tree.flatten(state)
        self._init(graphdef, config, mesh, tuple(leaves), treedef)

    def _init(self, graphdef, config, mesh, leaves, treedef) -> None:
        set_ = object.__setattr__
        set_(self, "graphdef", graphdef)
        set_(self, "config", config)
        set_(self, "mesh", mesh)
        set_(self, "_leaves", leaves)
        set_(self, "_treedef", treedef)

    def __setattr__(self, name, value):
        raise AttributeError(f"Params is immutable (setting {name!r}); use replace()")

    def __reduce__(self):  # copy / pickle through the public constructor
        return Params, (self.graphdef, self.state, self.config, self.mesh)

    @property
    def state(self) -> nnx.State:
        return jax.tree.unflatten(self._treedef, self._leaves)

    def replace(self, **changes) -> Params:
        """A copy with some of `graphdef`, `state`, `config`, `mesh` replaced."""
        bad = set(changes) - {"graphdef", "state", "config", "mesh"}
        if bad:
            raise TypeError(f"Params has no field(s) {sorted(bad)}")
        if "state" in changes:
            leaves, treedef = jax.tree.flatten(changes["state"])
            leaves = tuple(leaves)
        else:
            leaves, treedef = self._leaves, self._treedef
        new = object.__new__(Params)
        new._init(
            changes.get("graphdef", self.graphdef),
            changes.get("config", self.config),
            changes.get("mesh", self.mesh),
            leaves,
            treedef,
        )
        return new

    def tree_flatten(self):
        return self._leaves, (self.graphdef, self._treedef, self.config, self.mesh)

    @classmethod
    def tree_unflatten(cls, aux, leaves) -> Params:
        graphdef, treedef, config, mesh = aux
        new = object.__new__(cls)
        new._init(graphdef, config, mesh, tuple(leaves), treedef)
        return new

    def __repr__(self) -> str:
        return f"Params({self.config!r}, {len(self._leaves)} arrays, mesh={self.mesh})"

    def merge(self) -> Llama:
        """The module again (cheap; used inside traced functions)."""
        return nnx.merge(self.graphdef, self.state)


def split_model(model: Llama) -> Params:
    """Splits a model once for the hot path."""
    graphdef, state = nnx.split(model)
    return Params(graphdef=graphdef, state=state, config=model.cfg)


def init_params(cfg: ModelConfig, seed: int = 0) -> Params:
    """A randomly initialised model, already split."""
    return split_model(Llama(cfg, rngs=nnx.Rngs(seed)))


def _path_key(path) -> str:
    return ".".join(str(p) for p in path)


def params_to_flat(params: Params) -> dict[str, jax.Array]:
    """{dotted path: array} for every parameter (the keys in the module docstring)."""
    return {_path_key(path): var.get_value() for path, var in nnx.to_flat_state(params.state)}


def param_shapes(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """{dotted path: ShapeDtypeStruct} of a model of `cfg`, computed without allocating."""
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    _, state = nnx.split(abstract)
    return {_path_key(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def params_from_flat(cfg: ModelConfig, flat: dict) -> Params:
    """Builds `Params` from {dotted path: array}; every key must be present with its shape.

    Arrays are cast to `cfg.dtype`. Raises ValueError listing all missing, unexpected
    and mis-shaped keys at once.
    """
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    expected = {_path_key(p): (p, v) for p, v in nnx.to_flat_state(state)}
    shapes = {k: tuple(v.get_value().shape) for k, (_, v) in expected.items()}
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    bad_shape = [
        f"{k}: expected {shapes[k]}, got {tuple(np.shape(flat[k]))}"
        for k in sorted(set(expected) & set(flat))
        if tuple(np.shape(flat[k])) != shapes[k]
    ]
    if missing or unexpected or bad_shape:
        raise ValueError(
            f"parameters do not match the model: missing={missing}, "
            f"unexpected={unexpected}, bad shapes={bad_shape}"
        )
    dt = cfg.jnp_dtype
    pairs = []
    for key, (path, var) in expected.items():
        pairs.append((path, var.replace(jnp.asarray(flat[key], dt))))
    return Params(graphdef=graphdef, state=nnx.from_flat_state(pairs), config=cfg)


def forward(params: Params, tokens, *, kv_dtype=None):
    """Dense causal forward (pure): tokens [B, T] int -> logits [B, T, V] float32.

    `kv_dtype`: round K/V through this cache storage dtype first (see `Llama.__call__`).
    """
    return params.merge()(tokens, kv_dtype=kv_dtype)


def forward_paged(
    params: Params,
    cache: cache_lib.PagedKVCache,
    token_ids,
    positions,
    slot_mapping,
    page_table,
    context_lens,
    query_start_loc,
    logits_indices,
    *,
    decode: bool = False,
    backend: str = "auto",
    interpret: bool = False,
    lora=None,
    lora_slots=None,
    return_hidden: bool = False,
):
    """One paged step (pure; meant to be called inside a jitted step function).

    Args:
      params: the split model.
      cache: the paged KV cache; returned updated with this step's K/V.
      token_ids: [T] int32 this step's tokens, all sequences back to back.
      positions: [T] int32 each token's absolute position in its sequence.
      slot_mapping: [T] int32 cache slot of each token's K/V (-1: padding, dropped).
      page_table: [B, max_pages] int32.
      context_lens: [B] int32 tokens in the cache per sequence after this step.
      query_start_loc: [B + 1] int32 start of each sequence's rows in token_ids.
      logits_indices: [B] int32 which rows get logits (each sequence's last row).
      decode: every sequence has exactly one row and T == B (row b is sequence b);
        uses the decode kernel instead of the ragged one.
      backend: "auto" | "gpu" | "tpu" | "xla" for the attention kernels.
      interpret: run Pallas kernels in interpret mode (CPU testing).
      lora: `pagedjax.lora.LoRAWeights`: adds each token's adapter's update to the
        projections (None: no LoRA).
      lora_slots: [T] int32 with `lora`: each token's adapter slot (0: none).
      return_hidden: also return every token's final hidden state [T, E] (before the
        final norm), for `head_logits` (a prompt-logprobs step scores every token).

    With `params.mesh` set (`pagedjax.sharding.shard_params`), the step is tensor
    parallel: the cache must come from `pagedjax.sharding.create_cache` with that mesh.

    Returns:
      (logits [B, V] float32, new cache), and the hidden states with `return_hidden`.
    """
    return params.merge().paged(
        cache,
        token_ids,
        positions,
        slot_mapping,
        page_table,
        context_lens,
        query_start_loc,
        logits_indices,
        decode=decode,
        backend=backend,
        interpret=interpret,
        mesh=params.mesh,
        lora=lora,
        lora_slots=lora_slots,
        return_hidden=return_hidden,
    )


def head_logits(params: Params, hidden):
    """Whole float32 logits [N, V] of final hidden rows [N, E] from `forward_paged(...,
    return_hidden=True)`: the final norm and the LM head (all-gathered under a mesh)."""
    return params.merge().head(hidden, params.mesh)
