"""pagedjax.model: RoPE, the dense forward against plain numpy, the paged forward, params."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params

from pagedjax import cache as cache_lib
from pagedjax import model
from pagedjax.config import PRESETS, CacheConfig, ModelConfig, RopeScaling

TINY = PRESETS["tiny"]


# --- plain-numpy Llama, written from the HF definitions, float64 ---------------------


def np_inv_freq(cfg: ModelConfig) -> np.ndarray:
    d = cfg.head_dim
    out = []
    for i in range(0, d, 2):
        f = 1.0 / cfg.rope_theta ** (i / d)
        rs = cfg.rope_scaling
        if rs is not None:
            wavelen = 2 * math.pi / f
            old = rs.original_max_position_embeddings
            if wavelen < old / rs.high_freq_factor:
                pass
            elif wavelen > old / rs.low_freq_factor:
                f = f / rs.factor
            else:
                smooth = (old / wavelen - rs.low_freq_factor) / (
                    rs.high_freq_factor - rs.low_freq_factor
                )
                f = (1 - smooth) * f / rs.factor + smooth * f
        out.append(f)
    return np.array(out)


def np_rope(x, positions, inv_freq):
    # x: [T, N, D]; HF: x * cos + rotate_half(x) * sin, cos = cat(freqs, freqs).
    ang = positions[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def np_forward(flat, cfg: ModelConfig, tokens):
    f = {k: np.asarray(v, np.float64) for k, v in flat.items()}
    t, h, kh, d = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv = np_inv_freq(cfg)
    pos = np.arange(t, dtype=np.float64)

    def rms(x, w):
        return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps)

    def lin(x, name):
        y = x @ f[name + ".kernel"]
        return y + f[name + ".bias"] if name + ".bias" in f else y

    x = f["embed_tokens.embedding"][np.asarray(tokens)]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = rms(x, f[p + "input_layernorm.scale"])
        q = np_rope(lin(a, p + "self_attn.q_proj").reshape(t, h, d), pos, inv)
        k = np_rope(lin(a, p + "self_attn.k_proj").reshape(t, kh, d), pos, inv)
        v = lin(a, p + "self_attn.v_proj").reshape(t, kh, d)
        o = np.zeros((t, h, d))
        for head in range(h):
            j = head // (h // kh)
            s = q[:, head] @ k[:, j].T / math.sqrt(d)
            s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            o[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, j]
        x = x + lin(o.reshape(t, h * d), p + "self_attn.o_proj")
        m = rms(x, f[p + "post_attention_layernorm.scale"])
        g = lin(m, p + "mlp.gate_proj")
        x = x + lin(g / (1 + np.exp(-g)) * lin(m, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms(x, f["norm.scale"])
    head_w = f["embed_tokens.embedding"].T if cfg.tie_embeddings else f["lm_head.kernel"]
    return x @ head_w


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# --- RoPE ------------------------------------------------------------------------------

LLAMA3 = dataclasses.replace(
    TINY, head_dim=128, num_heads=2, hidden_size=256, rope_theta=500000.0,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
)  # fmt: skip


def test_rope_llama3_scaling_matches_numpy():
    ours = model.rope_frequencies(LLAMA3)
    ref = np_inv_freq(LLAMA3)
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    # The grid must exercise all three regimes: kept, divided, interpolated.
    base = 1.0 / LLAMA3.rope_theta ** (np.arange(0, 128, 2) / 128)
    ratio = ref / base
    assert (ratio == 1).any() and np.isclose(ratio, 1 / 8).any()
    assert ((ratio > 1 / 8 + 1e-6) & (ratio < 1 - 1e-6)).any()
    unscaled = dataclasses.replace(LLAMA3, rope_scaling=None)
    np.testing.assert_allclose(model.rope_frequencies(unscaled), base, rtol=1e-6)


def test_apply_rope_matches_numpy_rotate_half():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, 3, 128)).astype(np.float32)
    pos = np.array([0, 1, 2, 17, 63, 64, 200, 401, 511])
    inv = model.rope_frequencies(LLAMA3)
    out = model.apply_rope(jnp.asarray(x), jnp.asarray(pos), inv)
    ref = np_rope(x.astype(np.float64), pos.astype(np.float64), inv.astype(np.float64))
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_allclose(np.asarray(out)[0], x[0], rtol=1e-6)  # position 0 is identity


# --- dense forward against numpy ---------------------------------------------------------

VARIANTS = {
    "gqa": TINY,
    "qwen_bias_tied": dataclasses.replace(TINY, qkv_bias=True, tie_embeddings=True),
    # HF attention_bias (Llama, Qwen3): o_proj has a bias too.
    "llama_attention_bias": dataclasses.replace(TINY, qkv_bias=True, o_bias=True),
    "llama3_mqa": dataclasses.replace(
        TINY, num_kv_heads=1, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)
    ),
    "mha": dataclasses.replace(TINY, num_kv_heads=4, num_layers=1),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_dense_forward_matches_numpy(name):
    cfg = VARIANTS[name]
    params = random_params(cfg, seed=1)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 13))
    out = jax.jit(model.forward)(params, jnp.asarray(tokens))
    assert out.shape == (2, 13, cfg.vocab_size) and out.dtype == jnp.float32
    flat = model.params_to_flat(params)
    for b in range(2):
        assert rel_err(out[b], np_forward(flat, cfg, tokens[b])) < 1e-5
    if cfg.o_bias:  # the random o_proj biases move the logits: a model without them fails
        no_o_bias = {k: v for k, v in flat.items() if not k.endswith("o_proj.bias")}
        assert len(no_o_bias) == len(flat) - cfg.num_layers
        assert rel_err(out[0], np_forward(no_o_bias, cfg, tokens[0])) > 0.05


def test_forward_is_differentiable():
    params = random_params(TINY)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 8)))

    def loss(state):
        logits = model.forward(model.Params(params.graphdef, state, TINY), tokens[:, :-1])
        lp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()

    grads = jax.jit(jax.grad(loss))(params.state)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(model.param_shapes(TINY))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_bf16_params_track_f32():
    cfg = dataclasses.replace(TINY, dtype="bfloat16")
    p32 = random_params(TINY, seed=3)
    p16 = model.params_from_flat(cfg, model.params_to_flat(p32))
    assert {x.dtype for x in jax.tree.leaves(p16.state)} == {jnp.dtype(jnp.bfloat16)}
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, size=(1, 12)))
    out16 = jax.jit(model.forward)(p16, tokens)
    out32 = jax.jit(model.forward)(p32, tokens)
    assert out16.dtype == jnp.float32
    assert rel_err(out16, out32) < 2e-2


# --- paged forward -----------------------------------------------------------------------


def test_paged_forward_matches_dense_for_a_ragged_batch():
    """Prefill three prompts in one ragged step on shuffled pages, then one decode step.

    Uses the Qwen-style variant (qkv biases, tied head); pagedjax.decode's tests cover
    the plain Llama one through the full step.
    """
    cfg, s = VARIANTS["qwen_bias_tied"], 4
    params = random_params(cfg, seed=5)
    rng = np.random.default_rng(6)
    lens = [5, 8, 1]  # mid-page, exactly two pages, a single token
    prompts = [rng.integers(0, cfg.vocab_size, size=n) for n in lens]
    cache = cache_lib.create(cfg, CacheConfig(page_size=s, num_pages=12, dtype="float32"))
    page_table = np.zeros((4, 3), np.int32)  # one padding sequence row
    page_table[:3] = rng.permutation(np.arange(1, 12))[:9].reshape(3, 3)
    starts = np.concatenate([[0], np.cumsum(lens), [sum(lens)]]).astype(np.int32)
    t = 16
    tok = np.zeros(t, np.int32)
    pos = np.zeros(t, np.int32)
    slots = np.full(t, -1, np.int32)
    for b, p in enumerate(prompts):
        tok[starts[b] : starts[b + 1]] = p
        pos[starts[b] : starts[b + 1]] = np.arange(len(p))
        slots[starts[b] : starts[b + 1]] = cache_lib.slots_for(page_table[b], 0, len(p), s)
    ctx = np.array(lens + [0], np.int32)
    last = np.array([*(starts[1:4] - 1), 0], np.int32)
    fwd = jax.jit(model.forward_paged, static_argnames=("decode", "backend", "interpret"))
    logits, cache = fwd(
        params, cache, tok, pos, slots, page_table, ctx, starts, last, backend="xla"
    )
    nxt = np.asarray(logits).argmax(-1)[:3]
    # Dense oracle: one batched call on right-padded sequences (causal, so padding
    # after a sequence's end cannot change its logits).
    full = np.zeros((3, max(lens) + 1), np.int32)
    for b, p in enumerate(prompts):
        full[b, : lens[b]] = p
        full[b, lens[b]] = nxt[b]
    dense = jax.jit(model.forward)(params, jnp.asarray(full))
    for b in range(3):
        assert rel_err(logits[b], dense[b, lens[b] - 1]) < 1e-5
    # Decode: one token per sequence, row b is sequence b.
    d_tok = np.array([*nxt, 0], np.int32)
    d_pos = np.array([*lens, 0], np.int32)
    d_slots = np.array(
        [*(cache_lib.slots_for(page_table[b], lens[b], lens[b] + 1, s)[0] for b in range(3)), -1],
        np.int32,
    )
    d_ctx = np.array([n + 1 for n in lens] + [0], np.int32)
    d_starts = np.array([0, 1, 2, 3, 3], np.int32)
    logits2, cache = fwd(
        params, cache, d_tok, d_pos, d_slots, page_table, d_ctx, d_starts,
        np.arange(4, dtype=np.int32), decode=True, backend="xla",
    )  # fmt: skip
    for b in range(3):
        assert rel_err(logits2[b], dense[b, lens[b]]) < 1e-5
        # The cache holds exactly the keys of the whole sequence, nowhere else.
        k, _ = cache_lib.gather_sequence(cache, 0, page_table[b], lens[b] + 1)
        assert np.isfinite(np.asarray(k)).all() and float(jnp.abs(k).min(axis=(1, 2)).min()) > 0
    untouched = np.setdiff1d(np.arange(12), page_table[:3])
    assert float(jnp.abs(jnp.stack(cache.k)[:, :, untouched]).max()) == 0


# --- parameter table ---------------------------------------------------------------------


def _docstring_table(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    sizes = dict(
        V=cfg.vocab_size, E=cfg.hidden_size, I=cfg.intermediate_size,
        H=cfg.num_heads, K=cfg.num_kv_heads, D=cfg.head_dim,
    )  # fmt: skip
    table = {}
    for line in model.__doc__.splitlines():
        m = re.match(r"\s{4}(\S+)\s+\[([^\]]*)\]\s+(.*)$", line)
        if not m:
            continue
        path, dims, note = m.groups()
        if "(qkv_bias)" in note and not cfg.qkv_bias:
            continue
        if "(o_bias)" in note and not cfg.o_bias:
            continue
        if "(qk_norm)" in note and not cfg.qk_norm:
            continue
        if "(untied only)" in note and cfg.tie_embeddings:
            continue
        shape = tuple(eval(dim, {}, sizes) for dim in dims.split(","))  # noqa: S307
        for i in range(cfg.num_layers):
            table[path.replace("{i}", str(i))] = shape
    return table


TABLE_VARIANTS = {
    **VARIANTS,  # Qwen3: q/k norms, and H * D = 128 != E = 64
    "qwen3": dataclasses.replace(TINY, qk_norm=True, head_dim=32, tie_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(TABLE_VARIANTS))
def test_docstring_param_table_is_exact(name):
    cfg = TABLE_VARIANTS[name]
    shapes = {k: v.shape for k, v in model.param_shapes(cfg).items()}
    assert shapes == _docstring_table(cfg)
    assert {v.dtype for v in model.param_shapes(cfg).values()} == {jnp.dtype(cfg.jnp_dtype)}


def test_params_from_flat_reports_every_problem():
    flat = model.params_to_flat(random_params(TINY))
    del flat["norm.scale"], flat["layers.1.mlp.up_proj.kernel"]
    flat["layers.0.self_attn.q_proj.bias"] = np.zeros(64)
    flat["lm_head.kernel"] = np.zeros((256, 64))
    with pytest.raises(ValueError) as err:
        model.params_from_flat(TINY, flat)
    msg = str(err.value)
    for needle in ("norm.scale", "layers.1.mlp.up_proj.kernel", "q_proj.bias", "(64, 256)"):
        assert needle in msg


def test_params_flat_roundtrip_is_exact():
    params = random_params(TINY, seed=7)
    again = model.params_from_flat(TINY, model.params_to_flat(params))
    for a, b in zip(jax.tree.leaves(params.state), jax.tree.leaves(again.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert again.graphdef == params.graphdef


def test_params_flatten_to_their_arrays_only():
    """A jitted step flattens `Params` on every call: one node over the arrays, not the
    nnx.State's Variable per parameter (a Python callback each)."""
    params = random_params(TINY, seed=2)
    leaves, treedef = jax.tree.flatten(params)
    state_leaves = jax.tree.leaves(params.state)
    assert len(leaves) == len(state_leaves) == len(model.param_shapes(TINY))
    assert treedef.num_nodes == len(leaves) + 1
    assert all(a is b for a, b in zip(leaves, state_leaves, strict=True))
    # Round trip through jit and tree_map keeps everything but the arrays.
    doubled = jax.tree.map(lambda x: 2 * x, params)
    assert isinstance(doubled, model.Params)
    assert doubled.graphdef is params.graphdef and doubled.config is params.config
    flat, flat2 = model.params_to_flat(params), model.params_to_flat(doubled)
    for k in flat:
        np.testing.assert_array_equal(np.asarray(flat2[k]), 2 * np.asarray(flat[k]))
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, size=(1, 6)))
    assert rel_err(jax.jit(model.forward)(params, tokens), model.forward(params, tokens)) < 1e-5


def test_params_are_immutable_and_replace_checks_fields():
    params = random_params(TINY, seed=2)
    with pytest.raises(AttributeError, match="'config'"):
        params.config = TINY
    # `state` is rebuilt on each access: changing it changes nothing in `params`.
    state = params.state
    nnx_leaves = jax.tree.leaves(state)
    assert state is not params.state
    zeros = params.replace(state=jax.tree.map(jnp.zeros_like, state))
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(zeros))
    assert all(a is b for a, b in zip(jax.tree.leaves(params), nnx_leaves, strict=True))
    assert zeros.graphdef is params.graphdef and zeros.mesh is None
    with pytest.raises(TypeError, match="weights"):
        params.replace(weights=state)
    import copy
    import pickle

    for again in (copy.deepcopy(params), pickle.loads(pickle.dumps(params))):
        assert again.config == params.config
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
