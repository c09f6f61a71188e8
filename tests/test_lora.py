"""pagedjax.lora: PEFT adapters read and checked, and the per-token update of a paged step
equal to the dense forward of the adapter merged into the weights, for rows of several
adapters (and of none) in one step. The engine's use of them is in tests/test_lora_engine.py.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lora_helpers import write_peft
from params_helpers import random_params

from pagedjax import cache as cache_lib
from pagedjax import decode, lora, model
from pagedjax.config import PRESETS, CacheConfig

TINY = PRESETS["tiny"]
CACHE = CacheConfig(page_size=4, num_pages=24, dtype=TINY.dtype)


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=0)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    write_peft(root / "all", TINY, rank=4, alpha=8, seed=1)
    write_peft(root / "qv", TINY, rank=2, alpha=4, modules=("q_proj", "v_proj"), seed=2)
    write_peft(root / "mlp1", TINY, rank=3, alpha=3, modules=("down_proj",), layers=[1], seed=3)
    return {name: lora.load_adapter(root / name, TINY) for name in ("all", "qv", "mlp1")}


def test_load_adapter_folds_the_scaling(tmp_path):
    raw = write_peft(tmp_path / "a", TINY, rank=4, alpha=8, modules=("q_proj", "o_proj"))
    ad = lora.load_adapter(tmp_path / "a", TINY)
    assert ad.rank == 4 and set(ad.weights) == set(raw)
    for key, (a, b) in raw.items():
        wa, wb = ad.weights[key]
        np.testing.assert_allclose(wa @ wb, 2.0 * a.T @ b.T, rtol=1e-6)  # alpha / r = 2
    raw = write_peft(
        tmp_path / "rs",
        TINY,
        rank=4,
        alpha=8,
        modules=("q_proj", "k_proj"),
        config={"use_rslora": True, "alpha_pattern": {"q_proj": 2}},
    )
    ad = lora.load_adapter(tmp_path / "rs", TINY)
    for m, scaling in (("q_proj", 1.0), ("k_proj", 4.0)):  # alpha / sqrt(r)
        a, b = raw[1, m]
        wa, wb = ad.weights[1, m]
        np.testing.assert_allclose(wa @ wb, scaling * a.T @ b.T, rtol=1e-6)
    # rank_pattern: each module's scaling divides by its own rank
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    rng = np.random.default_rng(4)
    small = {f"{key}.lora_A.weight": rng.standard_normal((2, 64)).astype(np.float32)}
    small[f"{key}.lora_B.weight"] = rng.standard_normal((64, 2)).astype(np.float32)
    raw = write_peft(
        tmp_path / "rp",
        TINY,
        rank=4,
        alpha=8,
        modules=("q_proj", "v_proj"),
        tensors=small,
        config={"rank_pattern": {"model.layers.0.self_attn.q_proj": 2}},
    )
    ad = lora.load_adapter(tmp_path / "rp", TINY)
    assert ad.rank == 4 and ad.weights[0, "q_proj"][0].shape == (64, 2)
    raw[0, "q_proj"] = small[f"{key}.lora_A.weight"], small[f"{key}.lora_B.weight"]
    for m, scaling in (("q_proj", 4.0), ("v_proj", 2.0)):  # 8 / 2 and 8 / 4
        a, b = raw[0, m]
        wa, wb = ad.weights[0, m]
        np.testing.assert_allclose(wa @ wb, scaling * a.T @ b.T, rtol=1e-6)


_forward = jax.jit(model.forward)


def dense_logits(params, seq, width=16) -> np.ndarray:
    """[len(seq), V] logits of the dense forward of one sequence, padded to `width` so that
    one compiled program serves every length (causal: the padding changes no position
    before it; eager `model.forward` compiled each op anew for each length)."""
    buf = np.zeros((1, width), np.int32)
    buf[0, : len(seq)] = seq
    return np.asarray(_forward(params, jnp.asarray(buf)))[0, : len(seq)]


def _chunks(prompts, slots):
    tables, nxt = [], 0
    for p in prompts:
        n = -(-(len(p) + 2) // CACHE.page_size)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    chunks = [
        decode.SeqChunk(p, start_pos=0, page_table=t, lora_slot=s)
        for p, t, s in zip(prompts, tables, slots, strict=True)
    ]
    return chunks, tables


def test_paged_step_matches_the_merged_dense_forward(params, adapters):
    """Three adapters and the base model in one prefill step and one decode step: each
    row's logits equal the dense forward of its adapter merged into the weights."""
    weights = lora.create_lora_weights(TINY, max_loras=3, max_lora_rank=4)
    names = ("all", "qv", "mlp1")
    for slot, name in enumerate(names, start=1):
        weights = lora.write_slot(weights, slot, adapters[name])
    refs = [lora.merge_adapter(params, adapters[n]) for n in names] + [params]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (5, 9, 3, 6)]
    slots = [1, 2, 3, 0]
    chunks, tables = _chunks(prompts, slots)
    cache = cache_lib.create(TINY, CACHE)
    inp = decode.build_step_input(chunks, TINY, CACHE)
    assert inp.lora_slots is not None
    out, cache = decode.prefill_step(
        params, cache, inp, backend="xla", return_logits=True, lora=weights
    )
    nxt = np.asarray(out.tokens)[: len(prompts)]
    base = None
    for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        want = dense_logits(ref, p + [int(nxt[i])])
        np.testing.assert_allclose(out.logits[i], want[-2], rtol=2e-4, atol=2e-4)
        if i == 3:
            base = want
    # The adapters change the logits (a no-op LoRA path would pass the above only for row 3).
    plain = dense_logits(params, prompts[0])[-1]
    assert np.abs(np.asarray(out.logits[0]) - plain).max() > 1e-2
    dec = [
        decode.SeqChunk([int(t)], start_pos=len(p), page_table=tb, lora_slot=s)
        for t, p, tb, s in zip(nxt, prompts, tables, slots, strict=True)
    ]
    inp = decode.build_step_input(dec, TINY, CACHE)
    out, cache = decode.decode_step(
        params, cache, inp, backend="xla", return_logits=True, lora=weights
    )
    for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        want = dense_logits(ref, p + [int(nxt[i])])[-1]
        np.testing.assert_allclose(out.logits[i], want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(out.logits[3], base[-1], rtol=2e-4, atol=2e-4)


def test_write_slot_replaces_the_whole_slot(params, adapters):
    """A slot rewritten with an adapter of fewer modules and a smaller rank holds nothing
    of the one before; None empties it."""
    w = lora.create_lora_weights(TINY, max_loras=2, max_lora_rank=4)
    w = lora.write_slot(w, 2, adapters["all"])
    w = lora.write_slot(w, 2, adapters["qv"])
    for m in lora.TARGET_MODULES:
        a, b = w.stacked(m)
        assert not a[:, :, :4].any() and not b[:, :4].any()  # slot 1 untouched
        if m not in ("q_proj", "v_proj"):
            assert not a.any() and not b.any(), m
        else:
            got = a[0, :, 4:] @ b[0, 4:]
            wa, wb = adapters["qv"].weights[0, m]
            np.testing.assert_allclose(got, wa @ wb, rtol=1e-5, atol=1e-6)
            assert not a[0, :, 6:].any()  # rank 2 of 4: the rest zero
    w = lora.write_slot(w, 2, None)
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(w))


def test_slots_zero_and_a_step_without_slots_are_the_base_model(params, adapters):
    weights = lora.write_slot(
        lora.create_lora_weights(TINY, max_loras=1, max_lora_rank=4), 1, adapters["all"]
    )
    prompts = [[3, 4, 5, 6, 7]]
    chunks, _ = _chunks(prompts, [0])
    inp = decode.build_step_input(chunks, TINY, CACHE)
    assert inp.lora_slots is None  # no chunk has a slot
    cache = cache_lib.create(TINY, CACHE)
    out, _ = decode.prefill_step(
        params, cache, inp, backend="xla", return_logits=True, lora=weights
    )
    want = dense_logits(params, prompts[0])[-1]
    np.testing.assert_allclose(out.logits[0], want, rtol=2e-4, atol=2e-4)


def test_step_refuses_bad_slots(params):
    weights = lora.create_lora_weights(TINY, max_loras=2, max_lora_rank=2)
    chunks, _ = _chunks([[1, 2, 3]], [3])
    inp = decode.build_step_input(chunks, TINY, CACHE)
    cache = cache_lib.create(TINY, CACHE)
    with pytest.raises(ValueError, match=r"slot 3; the LoRA weights have slots 1\.\.2"):
        decode.prefill_step(params, cache, inp, backend="xla", lora=weights)
    with pytest.raises(ValueError, match="lora_slots given without LoRA weights"):
        decode.prefill_step(params, cache, inp, backend="xla")
    with pytest.raises(TypeError, match="lora must be a pagedjax.lora.LoRAWeights"):
        decode.prefill_step(params, cache, inp, backend="xla", lora={"a": 1})
    chunks, _ = _chunks([[1, 2, 3]], [-1])
    with pytest.raises(ValueError, match=r"sequence 0: lora_slot must be in \[0, 2\*\*31\)"):
        decode.build_step_input(chunks, TINY, CACHE)
    narrow = lora.create_lora_weights(dataclasses.replace(TINY, intermediate_size=64), 2, 2)
    chunks, _ = _chunks([[1, 2, 3]], [1])
    inp = decode.build_step_input(chunks, TINY, CACHE)
    with pytest.raises(ValueError, match=r"LoRA weights of gate_proj: .* do not fit the model"):
        decode.prefill_step(params, cache, inp, backend="xla", lora=narrow)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(config={"bias": "all"}), "bias='all' is not supported"),
        (dict(config={"use_dora": True}), "use_dora=True is not supported"),
        (dict(config={"context_length": 16384}), "context_length=16384 is not supported"),
        (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
        (dict(config={"fan_in_fan_out": True}), "fan_in_fan_out=True"),
        (dict(config={"peft_type": "IA3"}), "peft_type='IA3': only LoRA"),
        # activated LoRA (aLoRA) applies only from its invocation tokens on: served as a
        # plain LoRA it would change every token
        (dict(config={"alora_invocation_tokens": [5, 6]}), "alora_invocation_tokens=.5, 6."),
        # duplicated layers (a deeper model than the base), a bias on lora_B, QA-LoRA's
        # pooled inputs: each a model the update alone does not describe
        (dict(config={"layer_replication": [[0, 2], [1, 2]]}), "layer_replication="),
        (dict(config={"lora_bias": True}), "lora_bias=True is not supported"),
        (dict(config={"use_qalora": True}), "use_qalora=True is not supported"),
        (dict(config={"use_rslora": "false"}), "use_rslora must be true or false, got 'false'"),
        # PEFT builds each module with rank `r` (or rank_pattern's) and fails on other
        # tensors; vLLM would scale them by lora_alpha / r: neither is lora_alpha / 4
        (dict(config={"r": 16}), r"layer 0 q_proj: rank 2, but adapter_config.json's r is 16"),
        (
            dict(config={"rank_pattern": {"q_proj": 8}}),
            r"layer 0 q_proj: rank 2, but adapter_config.json's rank_pattern\['q_proj'\] is 8",
        ),
        (
            dict(config={"rank_pattern": {"q_proj": "2"}}),
            r"rank_pattern\['q_proj'\] must be a positive int, got '2'",
        ),
        (dict(config={"lora_alpha": -1}), "lora_alpha must be a positive number"),
        (
            dict(config={"alpha_pattern": {"q_proj": "16"}}),
            r"alpha_pattern\['q_proj'\] must be a positive number, got '16'",
        ),
        (dict(config={"alpha_pattern": {"q_(": 4}}), r"alpha_pattern key 'q_\(' is not a regex"),
        (
            dict(tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": None}),
            "layer 0 q_proj: lora_B is missing",
        ),
        (
            dict(
                tensors={
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros(
                        (2, 65), np.float32
                    )
                }
            ),
            r"lora_A \[2, 65\] and lora_B \[64, 2\] do not fit the model's q_proj "
            r"\(64 in, 64 out\)",
        ),
        (
            dict(
                tensors={
                    "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros(
                        (2, 256), np.float32
                    )
                }
            ),
            "embed_tokens.lora_embedding_A' is not a LoRA A/B weight",
        ),
        (
            dict(
                tensors={
                    "base_model.model.model.layers.5.mlp.up_proj.lora_A.weight": np.zeros(
                        (2, 64), np.float32
                    )
                }
            ),
            "layer 5 >= the model's 2",
        ),
        (
            dict(
                tensors={
                    "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": np.zeros(
                        (2, 64), np.float32
                    )
                }
            ),
            "mlp.q_proj.lora_A.weight' is not a LoRA A/B weight",
        ),
        (
            dict(
                tensors={
                    "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight": np.zeros(
                        (128, 2), np.int32
                    )
                }
            ),
            r"layers\.1\.mlp\.up_proj\.lora_B\.weight' has dtype I32: LoRA weights must be",
        ),
        (
            dict(
                tensors={
                    "model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 64), np.float32)
                }
            ),
            "'model.layers.0.self_attn.q_proj.lora_A.weight' and "
            "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' are both",
        ),
    ],
)
def test_load_adapter_refuses(tmp_path, change, match):
    write_peft(tmp_path / "bad", TINY, rank=2, modules=("q_proj", "up_proj"), **change)
    with pytest.raises(ValueError, match=match):
        lora.load_adapter(tmp_path / "bad", TINY)


def test_load_adapter_refuses_missing_files_and_large_ranks(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        lora.load_adapter(tmp_path / "nope", TINY)
    write_peft(tmp_path / "a", TINY, rank=8, modules=("q_proj",))
    with pytest.raises(FileNotFoundError, match="is a file: give the PEFT adapter's directory"):
        lora.load_adapter(tmp_path / "a" / "adapter_config.json", TINY)
    with pytest.raises(ValueError, match="has rank 8 > max_lora_rank=4"):
        lora.load_adapter(tmp_path / "a", TINY, max_rank=4)
    (tmp_path / "a" / "adapter_model.safetensors").rename(tmp_path / "a" / "adapter_model.bin")
    with pytest.raises(FileNotFoundError, match="adapter_model.bin is pickled torch"):
        lora.load_adapter(tmp_path / "a", TINY)
    (tmp_path / "a" / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        lora.load_adapter(tmp_path / "a", TINY)


def test_lora_request_checks():
    r = lora.LoRARequest("x", np.int64(3), pathlib.Path("/a"))
    assert r.lora_int_id == 3 and type(r.lora_int_id) is int and r.lora_path == "/a"
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="lora_int_id must be a positive int"):
            lora.LoRARequest("x", bad, "/a")
    with pytest.raises(ValueError, match="lora_name must be a non-empty str"):
        lora.LoRARequest("", 1, "/a")
    with pytest.raises(TypeError, match="lora_path must be a str or a path"):
        lora.LoRARequest("x", 1, None)


def test_lora_path_expands_the_home(monkeypatch, tmp_path):
    # vLLM resolves "~/adapter" to the home's; a JSON request (load_lora_adapter) has no
    # shell to expand it, and the path "did not exist".
    monkeypatch.setenv("HOME", str(tmp_path))
    r = lora.LoRARequest("x", 1, "~/adapters/a")
    assert r.lora_path == str(tmp_path / "adapters" / "a")
    assert lora.LoRARequest("x", 1, "a~b").lora_path == "a~b"


def test_dims_match_the_model():
    shapes = model.param_shapes(TINY)
    for m, block in lora.TARGET_MODULES.items():
        assert tuple(shapes[f"layers.0.{block}.{m}.kernel"].shape) == lora.module_dims(TINY, m)
    w = lora.create_lora_weights(TINY, max_loras=2, max_lora_rank=3)
    assert w.num_slots == 2 and [x.shape for x in w.a["q_proj"]] == [(64, 6)] * 2
    assert w.b["down_proj"][1].shape == (6, 64) and w.a["down_proj"][0].dtype == jnp.float32
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="max_loras must be a positive int"):
            lora.create_lora_weights(TINY, max_loras=bad, max_lora_rank=3)


def test_decode_generate_takes_lora_slots(params, adapters):
    """The static-batch loop: each prompt's tokens equal those of its merged model."""
    weights = lora.create_lora_weights(TINY, max_loras=2, max_lora_rank=4)
    weights = lora.write_slot(lora.write_slot(weights, 1, adapters["all"]), 2, adapters["qv"])
    prompts = [[5, 9, 13, 2, 7], [8, 8, 1], [4, 40, 44, 100]]
    kw = dict(max_new_tokens=6, page_size=4, backend="xla")
    got = decode.generate(params, prompts, lora=weights, lora_slots=[1, 0, 2], **kw).tokens
    refs = [lora.merge_adapter(params, adapters["all"]), params]
    refs.append(lora.merge_adapter(params, adapters["qv"]))
    for p, g, ref in zip(prompts, got, refs, strict=True):
        assert g == decode.generate(ref, [p], **kw).tokens[0]
    assert got[0] != decode.generate(params, prompts[:1], **kw).tokens[0]
    for kwargs, match in (
        (dict(lora_slots=[1, 0, 0]), "lora_slots needs lora"),
        (dict(lora=weights, lora_slots=[1]), "one slot per prompt \\(3\\), got 1"),
        (dict(lora=weights, lora_slots=[1, 3, 0]), r"lora_slots\[1\] must be an int in \[0, 2\]"),
    ):
        with pytest.raises(ValueError, match=match):
            decode.generate(params, prompts, **kw, **kwargs)


def test_adapter_from_state_equals_the_directory(tmp_path):
    raw = write_peft(tmp_path / "a", TINY, rank=3, alpha=6, modules=("q_proj", "down_proj"))
    state = {}
    for (layer, m), (a, b) in raw.items():
        key = f"base_model.model.model.layers.{layer}.{lora.TARGET_MODULES[m]}.{m}"
        state[f"{key}.lora_A.weight"] = jnp.asarray(a)  # jax arrays, as a JAX trainer has
        state[f"{key}.lora_B.weight"] = b
    mem = lora.adapter_from_state(state, {"r": 3, "lora_alpha": 6}, TINY)
    disk = lora.load_adapter(tmp_path / "a", TINY)
    assert mem.rank == disk.rank == 3 and mem.path is None and set(mem.weights) == set(disk.weights)
    for k, (a, b) in disk.weights.items():
        np.testing.assert_array_equal(mem.weights[k][0], a)
        np.testing.assert_array_equal(mem.weights[k][1], b)
    bad = dict(state)
    bad.pop(next(k for k in state if k.endswith("q_proj.lora_B.weight")))
    with pytest.raises(ValueError, match="the adapter state: layer 0 q_proj: lora_B is missing"):
        lora.adapter_from_state(bad, {"r": 3, "lora_alpha": 6}, TINY)
    with pytest.raises(ValueError, match="LoRA adapter the adapter has rank 3 > max_lora_rank=2"):
        lora.adapter_from_state(state, {"r": 3}, TINY, max_rank=2)
    with pytest.raises(ValueError, match="the adapter config: use_dora=True is not supported"):
        lora.adapter_from_state(state, {"use_dora": True}, TINY)
    nan = dict(state) | {next(iter(state)): np.full((3, 64), np.nan, np.float32)}
    with pytest.raises(ValueError, match="LoRA weights of layer 0 q_proj are not all finite"):
        lora.adapter_from_state(nan, {"r": 3}, TINY)
    with pytest.raises(TypeError, match="state must be a dict of arrays"):
        lora.adapter_from_state([1], {}, TINY)
    ints = dict(state) | {next(iter(state)): np.ones((3, 64), np.int64)}
    with pytest.raises(ValueError, match="q_proj.lora_A.weight' has dtype int64: LoRA weights"):
        lora.adapter_from_state(ints, {"r": 3}, TINY)
    with pytest.raises(ValueError, match=r"tensor 0 is not a LoRA A/B weight"):
        lora.adapter_from_state({0: a}, {"r": 3}, TINY)
    # bfloat16 jax arrays, and PEFT's lora_alpha of 8 for a config without one
    bf16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in state.items()}
    mem = lora.adapter_from_state(bf16, {"r": 3}, TINY)
    for (layer, m), (a, b) in raw.items():
        a16, b16 = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (a, b))
        wa, wb = mem.weights[layer, m]
        np.testing.assert_allclose(wa @ wb, 8 / 3 * a16.T @ b16.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "family",
    [
        dict(qkv_bias=True),  # Qwen2: the update adds to a biased projection
        dict(qkv_bias=True, o_bias=True, qk_norm=True),  # Qwen3: q/k norms after the update
        dict(sliding_window=5),  # Mistral: a window shorter than the prompts
    ],
    ids=["qwen2", "qwen3", "window"],
)
def test_every_family_matches_its_merged_dense_forward(tmp_path, family):
    cfg = dataclasses.replace(TINY, **family)
    params = random_params(cfg, seed=7)
    write_peft(tmp_path / "a", cfg, rank=3, alpha=6, seed=8)
    adapter = lora.load_adapter(tmp_path / "a", cfg)
    weights = lora.write_slot(lora.create_lora_weights(cfg, 1, 4), 1, adapter)
    prompts = [[7, 3, 9, 11, 40, 41, 42, 5, 6], [9, 8, 7, 6, 5, 4, 3]]
    kw = dict(max_new_tokens=5, page_size=4, backend="xla", return_logits=True)
    got = decode.generate(params, prompts, lora=weights, lora_slots=[1, 0], **kw)
    for p, toks, logits, ref in zip(
        prompts, got.tokens, got.logits, [lora.merge_adapter(params, adapter), params], strict=True
    ):
        full = dense_logits(ref, p + toks)
        np.testing.assert_allclose(logits, full[len(p) - 1 : -1], rtol=2e-4, atol=2e-4)
