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
from pagedjax import decode, model
from pagedjax.config import PRESETS, CacheConfig, ModelConfig, RopeScaling

TINY = PRESETS["tiny"]


# --- plain-numpy Llama, written from the HF definitions, float64 ---------------------


def np_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """HF's `_compute_{linear_scaling,llama3,yarn}_parameters` inverse frequencies, one
    pair at a time in float64."""
    d, rs = cfg.head_dim, cfg.rope_scaling
    if rs is not None and rs.rope_type == "yarn":
        # find_correction_dim: the dimension whose frequency turns n times over the
        # original context; the ramp runs from beta_fast's to beta_slow's.
        def correction_dim(n):
            turns = rs.original_max_position_embeddings / (n * 2 * math.pi)
            return (d * math.log(turns)) / (2 * math.log(cfg.rope_theta))

        low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # HF: "prevent singularity"
    out = []
    for i in range(0, d, 2):
        f = 1.0 / cfg.rope_theta ** (i / d)
        if rs is None:
            pass
        elif rs.rope_type == "linear":
            f = f / rs.factor
        elif rs.rope_type == "yarn":
            ramp = min(max((i // 2 - low) / (high - low), 0.0), 1.0)
            extrapolation = 1 - ramp  # HF's inv_freq_extrapolation_factor
            f = (f / rs.factor) * (1 - extrapolation) + f * extrapolation
        else:  # llama3
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


def np_attention_factor(cfg: ModelConfig) -> float:
    """HF's attention_factor (cos and sin are multiplied by it): 1 unless yarn."""
    rs = cfg.rope_scaling
    if rs is None or rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rs.mscale and rs.mscale_all_dim:
        return get_mscale(rs.factor, rs.mscale) / get_mscale(rs.factor, rs.mscale_all_dim)
    return get_mscale(rs.factor)


def np_rope(x, positions, inv_freq, attention_factor=1.0):
    # x: [T, N, D]; HF: x * cos + rotate_half(x) * sin, cos = cat(freqs, freqs) * factor.
    ang = positions[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :] * attention_factor
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :] * attention_factor
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def np_forward(flat, cfg: ModelConfig, tokens):
    f = {k: np.asarray(v, np.float64) for k, v in flat.items()}
    t, h, kh, d = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv, scale = np_inv_freq(cfg), np_attention_factor(cfg)
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
        q = np_rope(lin(a, p + "self_attn.q_proj").reshape(t, h, d), pos, inv, scale)
        k = np_rope(lin(a, p + "self_attn.k_proj").reshape(t, kh, d), pos, inv, scale)
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


def llama3_scaling(factor, original):
    return RopeScaling(
        "llama3",
        factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=original,
    )


LLAMA3 = dataclasses.replace(
    TINY, head_dim=128, num_heads=2, hidden_size=256, rope_theta=500000.0,
    rope_scaling=llama3_scaling(8.0, 8192),
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
    # yarn's attention factor multiplies cos and sin, so every rotated vector by it.
    scaled = model.apply_rope(jnp.asarray(x), jnp.asarray(pos), inv, 1.25)
    assert rel_err(scaled, np_rope(x.astype(np.float64), pos.astype(np.float64), inv, 1.25)) < 1e-5
    assert rel_err(scaled, 1.25 * np.asarray(out)) < 1e-6


def yarn(factor, original, **options):
    return RopeScaling("yarn", factor, original_max_position_embeddings=original, **options)


ROPE_CASES = {
    "llama3": LLAMA3,
    "linear": dataclasses.replace(LLAMA3, rope_theta=1e4, rope_scaling=RopeScaling("linear", 2.0)),
    # The Qwen2.5 / Qwen3 model cards' yarn: factor 4 over their 32768-token pretraining.
    "qwen3_yarn": dataclasses.replace(LLAMA3, rope_theta=1e6, rope_scaling=yarn(4.0, 32768)),
    # DeepSeek-style: the attention factor from mscale / mscale_all_dim.
    "deepseek_yarn": dataclasses.replace(
        LLAMA3, head_dim=64, rope_theta=1e4,
        rope_scaling=yarn(40.0, 4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707),
    ),
    # gpt-oss-style: the correction range not rounded out to whole pairs.
    "yarn_no_truncate": dataclasses.replace(
        LLAMA3, head_dim=64, rope_theta=150000.0, rope_scaling=yarn(32.0, 4096, truncate=False)
    ),
    "yarn_explicit": dataclasses.replace(
        LLAMA3,
        rope_scaling=yarn(8.0, 8192, beta_fast=16, beta_slow=2, attention_factor=1.25, mscale=1),
    ),
    # Both ends of the range clip to pair 0 (original context 4): HF widens it by 0.001.
    "yarn_empty_range": dataclasses.replace(LLAMA3, head_dim=16, rope_scaling=yarn(4.0, 4)),
    "yarn_factor_below_1": dataclasses.replace(LLAMA3, head_dim=64, rope_scaling=yarn(0.5, 4096)),
    # A range wider than the D / 2 pairs: [3, 16] clipped to [3, D - 1 = 15] (HF clips
    # to the head dim, not the pair count), so the ramp ends at 4/12 on the last pair.
    "yarn_wide_range": dataclasses.replace(
        LLAMA3, head_dim=16, rope_theta=10.0, rope_scaling=yarn(4.0, 512)
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
def test_rope_scaling_matches_numpy(name):
    cfg = ROPE_CASES[name]
    ref = np_inv_freq(cfg)
    np.testing.assert_allclose(model.rope_frequencies(cfg), ref, rtol=1e-6)
    assert model.rope_attention_factor(cfg) == pytest.approx(np_attention_factor(cfg), rel=1e-12)
    # Each case exercises what it is named for: kept, divided and blended pairs.
    rs, d = cfg.rope_scaling, cfg.head_dim
    ratio = ref / (1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d))
    kept, divided = np.isclose(ratio, 1), np.isclose(ratio, 1 / rs.factor)
    blended = ~kept & ~divided
    if name == "linear":
        assert divided.all()
    elif name == "yarn_empty_range":
        assert kept[0] and divided[1:].all()
    elif name == "yarn_wide_range":
        assert kept[:4].all() and blended[4:].all()
        np.testing.assert_allclose(ratio[-1], 1 - 4 / 12 * (1 - 1 / 4))
    else:
        assert kept.any() and divided.any() and blended.any()


def test_yarn_values_by_hand():
    """Qwen3's yarn (D 128, theta 1e6, factor 4, original 32768) worked by hand from HF's
    formulas: the pair turning n times over the original context is
    D ln(32768 / (2 pi n)) / (2 ln 1e6): 128 * 5.09359 / 27.63102 = 23.596 for n =
    beta_fast = 32 and 128 * 8.55933 / 27.63102 = 39.651 for n = beta_slow = 1, rounded
    out to [23, 40]. Pair 23 keeps 1e6^(-46/128), pair 40 is 1e6^(-80/128) / 4, pair
    30 blends 7/17 of the way: 1e6^(-60/128) * (10/17 + 7/17 / 4) = 1e6^(-60/128) * 47/68
    = 1.06436e-3. The attention factor is 0.1 ln 4 + 1 = 1.1386294361."""
    inv = model.rope_frequencies(ROPE_CASES["qwen3_yarn"])
    want = [1.0, 6.978306e-3, 1.0643610e-3, 4.445699e-5]
    np.testing.assert_allclose(inv[[0, 23, 30, 40]], want, rtol=1e-6)
    np.testing.assert_allclose(inv[30], 1e6 ** (-60 / 128) * 47 / 68, rtol=1e-6)
    assert model.rope_attention_factor(ROPE_CASES["qwen3_yarn"]) == pytest.approx(1.1386294361)
    # mscale 1, mscale_all_dim 0.707, factor 40 (ln 40 = 3.68888):
    # (0.1 * 3.68888 + 1) / (0.0707 * 3.68888 + 1) = 1.368888 / 1.260804 = 1.085726.
    assert model.rope_attention_factor(ROPE_CASES["deepseek_yarn"]) == pytest.approx(1.085726)
    # Equal mscales (DeepSeek-V3's 1 and 1) cancel; factor <= 1 scales nothing; an
    # explicit attention_factor wins over mscale; linear and llama3 never scale.
    v3 = dataclasses.replace(LLAMA3, rope_scaling=yarn(40.0, 4096, mscale=1, mscale_all_dim=1))
    assert model.rope_attention_factor(v3) == 1.0
    # HF takes the ratio only when both are set and nonzero; else m(1) = 1.368888.
    for one_sided in (dict(mscale=0.707), dict(mscale=0.707, mscale_all_dim=0.0)):
        cfg = dataclasses.replace(LLAMA3, rope_scaling=yarn(40.0, 4096, **one_sided))
        assert model.rope_attention_factor(cfg) == pytest.approx(1.368888, rel=1e-6)
    assert model.rope_attention_factor(ROPE_CASES["yarn_factor_below_1"]) == 1.0
    assert model.rope_attention_factor(ROPE_CASES["yarn_explicit"]) == 1.25
    assert model.rope_attention_factor(ROPE_CASES["linear"]) == 1.0
    assert model.rope_attention_factor(LLAMA3) == 1.0


# --- RMSNorm -----------------------------------------------------------------------------


def _hf_rms_norm(x, w, eps, dtype):
    """HF LlamaRMSNorm: normalise in float32, cast to the input dtype, then `weight * x`
    in that dtype (one rounding of the product)."""
    x64 = np.asarray(x, np.float64)
    y = (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)).astype(np.float32)
    return np.asarray(w, dtype) * y.astype(dtype)


@pytest.mark.parametrize(
    "dtype,magnitude,eps",
    [
        (jnp.bfloat16, 1.0, 1e-5),  # the product rounded once, in bfloat16
        (jnp.float16, 1000.0, 1e-5),  # x * x overflows float16: the mean must be float32
        (jnp.float32, 1e-3, 1e-5),  # mean(x^2) ~ 1e-6: eps moves the result
        (jnp.float32, 1.0, 0.5),
    ],
)
def test_rms_norm_is_hf_llamas(dtype, magnitude, eps):
    rng = np.random.default_rng(0)
    e = 256
    w = (1.0 + 0.2 * rng.normal(size=e)).astype(dtype)
    x = (magnitude * rng.normal(size=(32, e))).astype(dtype)
    norm = model.RMSNorm(e, eps, dtype)
    norm.scale[...] = jnp.asarray(w)
    out = np.asarray(jax.jit(lambda v: norm(v))(jnp.asarray(x)))
    ref = _hf_rms_norm(x, w, eps, dtype)
    assert out.dtype == ref.dtype == np.dtype(dtype) and np.isfinite(out).all()
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, ref, rtol=1e-5)
    else:  # bit-equal but for a rare last-bit flip of float32 rsqrt
        assert (out != ref).mean() < 0.01


# --- dense forward against numpy ---------------------------------------------------------

VARIANTS = {
    "gqa": TINY,
    "qwen_bias_tied": dataclasses.replace(TINY, qkv_bias=True, tie_embeddings=True),
    # HF attention_bias (Llama, Qwen3): o_proj has a bias too.
    "llama_attention_bias": dataclasses.replace(TINY, qkv_bias=True, o_bias=True),
    "llama3_mqa": dataclasses.replace(
        TINY, num_kv_heads=1, rope_theta=500000.0, rope_scaling=llama3_scaling(8.0, 64)
    ),
    # head_dim 16, original context 64: pair 0 kept, pairs 1 and 2 blended, 3 to 7
    # divided by 4; cos and sin times 0.1 ln 4 + 1, so the q.k logits times 1.296.
    "yarn": dataclasses.replace(
        TINY, rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=64)
    ),
    "linear": dataclasses.replace(TINY, rope_scaling=RopeScaling("linear", 2.0)),
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
    if cfg.rope_scaling is not None:  # as does the scaling, and yarn's attention factor
        unscaled = dataclasses.replace(cfg, rope_scaling=None)
        assert rel_err(out[0], np_forward(flat, unscaled, tokens[0])) > 0.05
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn":
        rs = dataclasses.replace(cfg.rope_scaling, attention_factor=1.0)
        no_factor = dataclasses.replace(cfg, rope_scaling=rs)
        assert rel_err(out[0], np_forward(flat, no_factor, tokens[0])) > 0.05
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


def test_generate_with_yarn_equals_dense_greedy():
    """decode.generate (chunked paged prefill on 4-token pages, then paged decode) with
    yarn on gives the dense forward's greedy tokens and logits; the dense forward
    matches numpy above, so the paged steps rotate and scale q and k as HF does."""
    cfg = VARIANTS["yarn"]
    params = random_params(cfg, seed=5)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (11, 3)]
    out = decode.generate(
        params,
        prompts,
        max_new_tokens=6,
        page_size=4,
        prefill_chunk=5,
        backend="xla",
        return_logits=True,
    )
    # Causal: the dense logits of prompt + generated tokens at position n - 1 + j are
    # what greedy token j was chosen from.
    full = np.zeros((2, 17), np.int32)
    for b, p in enumerate(prompts):
        full[b, : len(p) + 6] = p + out.tokens[b]
    dense = np.asarray(jax.jit(model.forward)(params, jnp.asarray(full)))
    for b, p in enumerate(prompts):
        want = dense[b, len(p) - 1 : len(p) + 5]
        assert out.tokens[b] == want.argmax(-1).tolist()
        assert rel_err(out.logits[b], want) < 1e-4


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
    # A missing key on its own is reported too (not a KeyError while building).
    only_missing = model.params_to_flat(random_params(TINY))
    del only_missing["norm.scale"]
    with pytest.raises(ValueError, match=r"missing=\['norm.scale'\], unexpected=\[\]"):
        model.params_from_flat(TINY, only_missing)


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


def test_params_replace_and_copy_keep_the_mesh():
    import copy

    params = random_params(TINY, seed=2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    on_mesh = params.replace(mesh=mesh)
    assert on_mesh.mesh is mesh and params.mesh is None
    assert on_mesh.replace(config=TINY).mesh is mesh
    leaves, treedef = jax.tree.flatten(on_mesh)
    assert jax.tree.unflatten(treedef, leaves).mesh is mesh
    assert copy.copy(on_mesh).mesh is mesh  # through __reduce__ (a Mesh's devices do not pickle)
