"""Tensor parallelism on 8 simulated CPU devices (run by tests/test_tensor_parallel.py).

`XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before JAX starts,
so this module is not collected with the rest of the suite (its name does not match
`test_*.py`); `tests/test_tensor_parallel.py` runs it in a subprocess:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -q tests/tp_cases.py

Every case runs the same steps (a prefill, a mixed prefill/decode step with a
copy-on-write page copy, then decode steps) at tp = 1 and at tp = N, on a tiny
model with 8 query heads and 2 or 8 kv heads (and one Qwen3-style variant with q/k
norms and a sliding window, at K = 2 with attention_bias: an o_proj bias, replicated
and added once after the row-split o_proj's all-reduce; one at K = 8 with q/k/v and
o_proj biases and an untied vocabulary tp does not divide; and, under `-m slow`, an MQA
variant: K = 1, head_dim 64, an FP8 cache and a tied vocabulary tp does not divide),
and compares greedy tokens, logits, the cache each device holds, and the collectives
in the compiled programs. The engine runs at tp = 4 too: tests/test_engine.py's
equality tests, sleep and weight updates, LoRA adapters split over the mesh, and a
mesh with a second axis besides "tp".
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys

if "jax" not in sys.modules:  # a direct `pytest tests/tp_cases.py` works too
    flag = "--xla_force_host_platform_device_count=8"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pagedjax import decode, planner, sharding  # noqa: E402
from pagedjax.config import CacheConfig, ModelConfig  # noqa: E402
from pagedjax.engine import LLM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_helpers  # noqa: E402
import test_engine as engine_tests  # noqa: E402  (its tests are not collected from here)
from params_helpers import random_params  # noqa: E402

if jax.device_count() < 8:
    raise RuntimeError(
        f"tests/tp_cases.py needs 8 devices, found {jax.device_count()}: set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts"
    )

NUM_LAYERS = 2
CACHE = CacheConfig(page_size=4, num_pages=32, dtype="float32")
PROMPT_LENS = (3, 11, 6)
CHUNK = 6  # the 11-token prompt is prefilled in two chunks: step 2 mixes prefill and decode
NEW_TOKENS = 5
COPY = (1, 30)  # copy-on-write in step 2: page 1 (sequence 0's first) -> unused page 30
COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)


def tiny(num_kv_heads: int, variant: str = "") -> ModelConfig:
    """8 query heads; K=2 has q/k/v biases, K=8 a tied LM head (both rule variants);
    variant "qk_norm_window" adds Qwen3's q/k norms and a window of 4 (shorter than
    two of the three prompts, so it masks in prefill as well as in decode), and at K=2
    an o_proj bias (Qwen3's attention_bias biases q/k/v and o_proj together); variant
    "mqa_fp8" has head_dim 64 and a tied vocabulary of 250, which tp = 8 does not
    divide (replicated), and runs with an FP8 cache (`cache_config`); variant
    "bias_vocab250" has q/k/v and o_proj biases (at K=8: k/v biases split with their
    heads), and an untied LM head over a vocabulary of 250 (replicated at tp = 4)."""
    cfg = ModelConfig(
        num_layers=NUM_LAYERS,
        num_heads=8,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
        qkv_bias=num_kv_heads == 2,
        tie_embeddings=num_kv_heads == 8,
        dtype="float32",
        eos_token_ids=(),
    )
    if variant == "qk_norm_window":
        return dataclasses.replace(cfg, qk_norm=True, o_bias=cfg.qkv_bias, sliding_window=4)
    if variant == "mqa_fp8":
        return dataclasses.replace(cfg, head_dim=64, vocab_size=250, tie_embeddings=True)
    if variant == "bias_vocab250":
        return dataclasses.replace(
            cfg, qkv_bias=True, o_bias=True, tie_embeddings=False, vocab_size=250
        )
    assert not variant, variant
    return cfg


def cache_config(variant: str = "") -> CacheConfig:
    return dataclasses.replace(CACHE, dtype="fp8") if variant == "mqa_fp8" else CACHE


def count_collectives(hlo: str) -> dict[str, int]:
    """{opcode: count} of the collective instructions in compiled HLO text."""
    counts = {}
    for op in COLLECTIVES:
        # An instruction's opcode follows its result type; names and operands start with %.
        n = len(re.findall(rf"(?<![%\w.\-]){op}(?:-start)?\(", hlo))
        if n:
            counts[op] = n
    return counts


@functools.cache
def run(
    num_kv_heads: int, tp: int, backend: str = "xla", interpret: bool = False, variant: str = ""
):
    """Runs the fixed step plan; returns (tokens, logits per step, cache, counts, params).

    Each program is compiled once with `.lower().compile()` (its HLO is inspected)
    and that executable runs the steps, so nothing is compiled twice.
    """
    cfg = tiny(num_kv_heads, variant)
    params = random_params(cfg)
    if tp > 1:
        params = sharding.shard_params(params, sharding.make_mesh(tp, cfg))
    cache_cfg = cache_config(variant)
    cache = sharding.create_cache(cfg, cache_cfg, params.mesh)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in PROMPT_LENS]
    pages = [list(range(1 + 6 * b, 7 + 6 * b)) for b in range(len(prompts))]
    done = [0] * len(prompts)  # tokens of each sequence in the cache
    out = [[] for _ in prompts]
    logits, programs, counts = [], {}, {}
    for step in range(2 + NEW_TOKENS):
        chunks = []
        for b, p in enumerate(prompts):
            new = p[done[b] : done[b] + CHUNK] if done[b] < len(p) else out[b][-1:]
            chunks.append(decode.SeqChunk(new, done[b], pages[b]))
        copies = [COPY] if step == 1 else []
        inp = decode.build_step_input(chunks, cfg, cache_cfg, copies=copies)
        if inp.decode not in programs:
            jitted = decode._decode_jit if inp.decode else decode._prefill_jit
            compiled = jitted.lower(
                params,
                cache,
                inp,
                backend=backend,
                interpret=interpret,
                num_top_logprobs=0,
                return_logits=True,
            ).compile()
            programs[inp.decode] = compiled
            counts["decode" if inp.decode else "prefill"] = count_collectives(compiled.as_text())
        res, cache = programs[inp.decode](params, cache, inp)
        logits.append(np.asarray(res.logits)[: len(prompts)])
        for b, c in enumerate(chunks):
            done[b] += len(c.token_ids)
            if done[b] >= len(prompts[b]):
                out[b].append(int(res.tokens[b]))
    return out, logits, cache, counts, params


def rel_err(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


CASES = [
    pytest.param(2, 2, "", id="K2-tp2"),
    pytest.param(2, 4, "", id="K2-tp4"),
    pytest.param(2, 8, "", id="K2-tp8"),
    pytest.param(8, 4, "", id="K8-tp4"),
    pytest.param(2, 4, "qk_norm_window", id="K2-tp4-qk_norm-window"),
    pytest.param(8, 4, "bias_vocab250", id="K8-tp4-bias-vocab250"),
    pytest.param(8, 2, "", id="K8-tp2", marks=pytest.mark.slow),
    pytest.param(8, 8, "", id="K8-tp8", marks=pytest.mark.slow),
    pytest.param(8, 2, "qk_norm_window", id="K8-tp2-qk_norm-window", marks=pytest.mark.slow),
    pytest.param(1, 8, "mqa_fp8", id="K1-tp8-mqa-fp8", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("num_kv_heads,tp,variant", CASES)
def test_greedy_tokens_and_logits_match_one_device(num_kv_heads, tp, variant):
    ref_tokens, ref_logits, *_ = run(num_kv_heads, 1, variant=variant)
    tokens, logits, *_ = run(num_kv_heads, tp, variant=variant)
    assert tokens == ref_tokens
    assert [len(t) for t in tokens] == [NEW_TOKENS + 2, NEW_TOKENS + 1, NEW_TOKENS + 2]
    for step, (out, ref) in enumerate(zip(logits, ref_logits, strict=True)):
        assert np.isfinite(out).all()
        assert rel_err(out, ref) < 1e-4, f"step {step}"


@pytest.mark.parametrize("num_kv_heads,tp,variant", CASES)
def test_each_device_holds_its_heads_slice_of_every_page(num_kv_heads, tp, variant):
    """K >= tp: device j holds kv heads [j*K/tp, (j+1)*K/tp), 1/tp of the cache.
    K < tp: device j holds the one kv head its query heads read, j // (tp/K)."""
    *_, ref_cache, _, _ = run(num_kv_heads, 1, variant=variant)
    *_, cache, _, params = run(num_kv_heads, tp, variant=variant)
    mesh_devices = list(params.mesh.devices.flat)
    per_device = max(num_kv_heads // tp, 1)
    single = ref_cache.k[0].nbytes  # one layer's K pool on one device
    # FP8: the same K/V computed on another device may round to a neighbouring value.
    tol = 0.07 if variant == "mqa_fp8" else 1e-5
    for layer in range(NUM_LAYERS):
        for pool, ref_pool in zip(cache.layer(layer), ref_cache.layer(layer), strict=True):
            assert pool.dtype == cache_config(variant).jnp_dtype
            ref_pool = np.asarray(ref_pool, np.float32)
            assert ref_pool[:, 30].any()  # the copied page holds data
            shards = sorted(pool.addressable_shards, key=lambda s: mesh_devices.index(s.device))
            assert len(shards) == tp
            for j, shard in enumerate(shards):
                assert shard.data.nbytes == single // min(tp, num_kv_heads)
                data = np.asarray(shard.data, np.float32)
                assert data.shape == (per_device, *ref_pool.shape[1:])
                if num_kv_heads >= tp:
                    heads = list(range(j * per_device, (j + 1) * per_device))
                else:
                    heads = [j // (tp // num_kv_heads)]
                np.testing.assert_allclose(data, ref_pool[heads], rtol=tol, atol=tol)
                # Copied before step 2 wrote sequence 0's 4th token into page 1's slot 3.
                np.testing.assert_array_equal(data[:, COPY[1], :3], data[:, COPY[0], :3])
                assert not data[:, COPY[1], 3:].any()


@pytest.mark.parametrize("num_kv_heads,tp,variant", CASES)
def test_compiled_steps_hold_only_the_collectives_tp_needs(num_kv_heads, tp, variant):
    """Per layer one all-reduce after o_proj and one after down_proj; plus one all-reduce
    for the vocab-split embedding lookup and one all-gather of the [B, V] logits for
    sampling (neither when tp does not divide the vocabulary: it is replicated).
    Nothing else: the cache write, attention and copy-on-write stay local."""
    *_, counts, _ = run(num_kv_heads, tp, variant=variant)
    if tiny(num_kv_heads, variant).vocab_size % tp:
        expected = {"all-reduce": 2 * NUM_LAYERS}
    else:
        expected = {"all-reduce": 2 * NUM_LAYERS + 1, "all-gather": 1}
    assert counts == {"prefill": expected, "decode": expected}
    *_, ref_counts, _ = run(num_kv_heads, 1, variant=variant)
    assert ref_counts == {"prefill": {}, "decode": {}}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_kernels_per_shard_in_interpret_mode(backend):
    ref_tokens, ref_logits, *_ = run(2, 1)
    tokens, logits, *_ = run(2, 4, backend, True)
    assert tokens == ref_tokens
    for out, ref in zip(logits, ref_logits, strict=True):
        assert rel_err(out, ref) < 1e-4


def test_bad_tensor_parallel_sizes_are_rejected():
    cfg = tiny(2)
    with pytest.raises(ValueError, match=r"tensor_parallel=3 must divide .* num_heads=8"):
        sharding.make_mesh(3, cfg)
    with pytest.raises(ValueError, match=r"tensor_parallel=16 needs 16 devices, but only 8"):
        sharding.make_mesh(16, cfg)
    with pytest.raises(ValueError, match=r"tensor_parallel=16 needs 16 devices, but only 8"):
        sharding.make_mesh(16)


def test_steps_refuse_a_cache_placed_off_the_models_mesh():
    """A tensor-parallel model with a one-device cache, or a one-device model with a
    cache split over a mesh, fails on the host by name (not inside jit)."""
    cfg = tiny(2)
    one = random_params(cfg)
    tp2 = sharding.shard_params(one, sharding.make_mesh(2, cfg))
    inp = decode.build_step_input([decode.SeqChunk([1, 2, 3], 0, [1])], cfg, CACHE)
    with pytest.raises(ValueError, match=r"not split over kv heads on the model's mesh"):
        decode.prefill_step(tp2, sharding.create_cache(cfg, CACHE), inp)
    with pytest.raises(ValueError, match=r"it is on 1 device, the model on 2"):
        decode.prefill_step(tp2, sharding.create_cache(cfg, CACHE), inp)
    tp4 = sharding.create_cache(cfg, CACHE, sharding.make_mesh(4, cfg))  # 2 kv heads, 4 rows
    for params in (one, tp2):  # it said only "K=2 kv heads ..., got (4, ...)"
        with pytest.raises(ValueError, match=r"got \(4, .*made for tensor_parallel=4"):
            decode.prefill_step(params, tp4, inp)
    split = sharding.create_cache(cfg, CACHE, tp2.mesh)
    with pytest.raises(ValueError, match=r"spread over 2 devices but the model has no mesh"):
        decode.prefill_step(one, split, inp)
    other = sharding.create_cache(
        cfg, CACHE, sharding.make_mesh(2, cfg, devices=jax.devices()[2:4])
    )
    with pytest.raises(ValueError, match=r"not split over kv heads on the model's mesh"):
        decode.prefill_step(tp2, other, inp)
    out, split = decode.prefill_step(tp2, split, inp)  # the matching cache runs
    assert out.tokens.shape[0] >= 1


def test_cache_and_params_refuse_a_mesh_the_model_cannot_use():
    """create_cache checked neither the model's split nor the mesh: a tp = 3 mesh for 8
    query heads failed as "num_kv_heads must divide num_heads, got ... num_kv_heads=3"
    (a value the user never set) or a bare IndivisibleError. A mesh from jax.make_mesh
    (Explicit axes) was accepted, and the step then failed inside tracing."""
    cfg = tiny(2)
    tp3 = sharding.make_mesh(3)
    with pytest.raises(ValueError, match=r"tensor_parallel=3 must divide .* num_heads=8"):
        sharding.create_cache(cfg, CACHE, tp3)
    with pytest.raises(ValueError, match=r"tensor_parallel=3 must divide .* num_heads=8"):
        sharding.create_cache(tiny(8), CACHE, tp3)
    odd = dataclasses.replace(cfg, num_heads=12, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"tensor_parallel=2 must divide num_kv_heads=3"):
        sharding.create_cache(odd, CACHE, sharding.make_mesh(2))
    explicit = jax.make_mesh((4,), (sharding.AXIS,))  # Explicit axes by default
    with pytest.raises(ValueError, match=r"AxisType.Auto, got \{'tp': 'Explicit'\}"):
        sharding.shard_params(random_params(cfg), explicit)
    with pytest.raises(ValueError, match=r"AxisType.Auto, got \{'tp': 'Explicit'\}"):
        sharding.create_cache(cfg, CACHE, explicit)


def test_orbax_restore_lands_on_the_default_device(tmp_path):
    """Under `jax.default_device` (as `sharding.host_staging` sets it before a model is
    split) an orbax checkpoint restores there, not onto the first device: on a GPU host
    that put a whole model meant for tp GPUs on GPU 0."""
    from pagedjax import weights

    cfg = tiny(2)
    weights.save_params(random_params(cfg), tmp_path / "ckpt")
    target = jax.devices()[3]
    with jax.default_device(target):
        _, params = weights.load_checkpoint(tmp_path / "ckpt")
    placed = {d for x in jax.tree.leaves(params) for d in x.devices()}
    assert placed == {target}


# --- the engine at tp = 4: tests/test_engine.py's equality tests, unchanged ---------------
# The tiny preset has 4 query heads and 2 kv heads, so at tp = 4 each kv head is
# replicated on 2 devices. LLM(params) with sharded params runs tensor parallel.


@pytest.fixture(scope="module")
def engine_params():
    return engine_helpers.random_params()


@pytest.fixture(scope="module")
def engine_dense(engine_params):
    return engine_helpers.Dense(engine_params)  # one device


@pytest.fixture(scope="module")
def tp4_params(engine_params):
    return sharding.shard_params(engine_params, sharding.make_mesh(4, engine_helpers.TINY))


@pytest.mark.parametrize(
    "caching,budget",
    [
        (True, 16),
        pytest.param(False, 16, marks=pytest.mark.slow),
        pytest.param(True, 13, marks=pytest.mark.slow),
    ],
)
def test_engine_tp4_greedy_with_prefix_caching_equals_dense(
    tp4_params, engine_dense, caching, budget
):
    engine_tests.test_greedy_equals_dense(tp4_params, engine_dense, caching, budget)


@pytest.mark.slow
def test_engine_tp4_prompt_logprobs_equal_dense(tp4_params, engine_dense, monkeypatch):
    """Prompt logprobs at tp = 4, the LM head scoring 5 rows at a time (its logits
    all-gathered inside the scoring loop): every entry is the dense model's."""
    monkeypatch.setattr(planner, "SCORE_ROWS", 5)
    engine_tests.test_prompt_logprobs_score_every_prompt_token(tp4_params, engine_dense)


@pytest.mark.slow
def test_scoring_tp4_equals_one_device(engine_params, tp4_params):
    """`scoring.score` at tp = 4 (the cache split over the mesh): one device's scores."""
    from pagedjax import scoring

    rng = np.random.default_rng(3)
    vocab = engine_helpers.TINY.vocab_size
    seqs = [rng.integers(3, vocab, n).tolist() for n in (9, 17, 4)]
    want = scoring.score(engine_params, seqs, top_k=3, page_size=4, prefill_chunk=6)
    got = scoring.score(tp4_params, seqs, top_k=3, page_size=4, prefill_chunk=6)
    for b in range(len(seqs)):
        np.testing.assert_allclose(got.logprobs[b], want.logprobs[b], atol=1e-5)
        np.testing.assert_allclose(got.top_logprobs[b], want.top_logprobs[b], atol=1e-5)
        np.testing.assert_array_equal(got.ranks[b], want.ranks[b])
        np.testing.assert_array_equal(got.top_ids[b], want.top_ids[b])


@pytest.mark.parametrize("beam", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_engine_tp4_preemption_keeps_outputs(tp4_params, engine_dense, beam):
    engine_tests.run_under_preemption(tp4_params, engine_dense, beam=beam)


def test_llm_tensor_parallel_argument(engine_params, engine_dense):
    llm = LLM(engine_params, tensor_parallel=4, **engine_helpers.GEOMETRY)
    assert llm.tensor_parallel == 4 and llm.params.mesh.shape == {sharding.AXIS: 4}
    cfg = engine_helpers.TINY
    for pool in llm.cache.k + llm.cache.v:  # K = 2 < tp: one kv head per device
        assert pool.shape == (4, engine_helpers.PAGES, engine_helpers.PS, cfg.head_dim)
        assert {s.data.shape[0] for s in pool.addressable_shards} == {1}
    prompts = engine_tests.prompts_with_shared_prefixes()[:4]
    outs = llm.generate(prompts, engine_helpers.greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == engine_dense.greedy(prompts, 6)
    engine_helpers.check_clean(llm)


def test_update_params_and_sleep_keep_the_tensor_parallel_placement(engine_params):
    """One-device weights given to a tp = 4 engine are sharded as its own (no
    recompile); sleep moves the sharded weights to host memory and wake_up back, with
    a new cache split over the mesh as the first was."""
    llm = LLM(engine_params, tensor_parallel=4, **engine_helpers.GEOMETRY)
    prompts = engine_tests.prompts_with_shared_prefixes()[:4]
    llm.generate(prompts, engine_helpers.greedy(6))
    shardings = [x.sharding for x in jax.tree.leaves(llm.params)]
    pools = [x.sharding for x in jax.tree.leaves(llm.cache)]
    new = engine_helpers.random_params(1)
    before = sum(decode.compile_counts().values())
    llm.sleep()
    assert {x.sharding.memory_kind for x in jax.tree.leaves(llm.params)} == {"pinned_host"}
    llm.wake_up()
    assert [x.sharding for x in jax.tree.leaves(llm.params)] == shardings
    llm.update_params(new)
    assert [x.sharding for x in jax.tree.leaves(llm.params)] == shardings
    assert [x.sharding for x in jax.tree.leaves(llm.cache)] == pools
    outs = llm.generate(prompts, engine_helpers.greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == engine_helpers.Dense(new).greedy(prompts, 6)
    assert sum(decode.compile_counts().values()) == before
    engine_helpers.check_clean(llm)


def test_llm_checks_the_split_before_loading_the_weights(tmp_path, monkeypatch):
    """A tensor_parallel the model cannot split (3 of 4 heads) was refused only after the
    weights were loaded (minutes and host memory for a large checkpoint); it is read
    from the checkpoint's config, for either kind of checkpoint."""
    from pagedjax import engine, weights

    cfg = engine_helpers.TINY
    hf, orbax = tmp_path / "hf", tmp_path / "orbax"
    weights.save_hf_checkpoint(engine_helpers.random_params(), cfg, hf)
    weights.save_params(engine_helpers.random_params(), orbax)

    def no_load(*a, **k):
        raise AssertionError("loaded the weights before checking tensor_parallel")

    monkeypatch.setattr(engine, "load_model", no_load)
    for source in (hf, str(orbax), cfg):
        with pytest.raises(ValueError, match=r"tensor_parallel=3 must divide .* num_heads=4"):
            LLM(source, tensor_parallel=3, **engine_helpers.GEOMETRY)


@pytest.mark.slow
def test_generate_script_tensor_parallel_4_matches_1(tmp_path, capsys):
    """scripts/generate.py --tensor-parallel 4: same greedy tokens as on one device."""
    import importlib.util
    import json

    from pagedjax import weights
    from pagedjax.resources import byte_tokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("gen", os.path.join(root, "scripts/generate.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    cfg = engine_helpers.TINY
    weights.save_hf_checkpoint(engine_helpers.random_params(), cfg, tmp_path)
    byte_tokenizer().tokenizer.save(str(tmp_path / "tokenizer.json"))
    argv = ["--checkpoint", str(tmp_path), "--prompt", "def f(x):", "--prompt", "import o"]
    argv += ["--max-tokens", "8", "--page-size", "8", "--num-pages", "64", "--backend", "xla"]
    results = []
    for tp in ("1", "4"):
        assert gen.main([*argv, "--json", "--tensor-parallel", tp]) == 0
        obj = json.loads(capsys.readouterr().out)
        assert obj["settings"]["tensor_parallel"] == int(tp)
        results.append([o["completions"][0]["token_ids"] for o in obj["outputs"]])
    assert results[0] == results[1] and all(results[0])


def test_engine_tp4_lora_equals_merged_dense(engine_params, tmp_path):
    """LoRA at tp = 4: each adapter's a and b split as the projection they add to
    (`pagedjax.lora`), and rows of two adapters and of none in one batch give the dense
    greedy tokens of each adapter merged into the weights."""
    from lora_helpers import write_peft

    from pagedjax import lora

    cfg = engine_helpers.TINY
    reqs = {}
    for i, (name, mods) in enumerate((("a", None), ("b", ("k_proj", "o_proj", "up_proj"))), 1):
        write_peft(tmp_path / name, cfg, rank=4, modules=mods or lora.TARGET_MODULES, seed=i)
        reqs[name] = lora.LoRARequest(name, i, str(tmp_path / name))
    llm = LLM(
        engine_params,
        tensor_parallel=4,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=4,
        **engine_helpers.GEOMETRY,
    )
    prompts = engine_tests.prompts_with_shared_prefixes()[:6]
    names = ["a", "b", None, "b", "a", None]
    outs = llm.generate(
        prompts, engine_helpers.greedy(6), lora_request=[reqs[n] if n else None for n in names]
    )
    for p, n, o in zip(prompts, names, outs, strict=True):
        params = engine_params
        if n:
            params = lora.merge_adapter(params, lora.load_adapter(reqs[n].lora_path, cfg))
        assert o.outputs[0].token_ids == engine_helpers.Dense(params).greedy([p], 6)[0], n
    w = llm.lora.weights  # each device's shard of layer 1's ([in, S*R] and [S*R, out], S*R = 8)
    shard = {k: {s.data.shape for s in x[1].addressable_shards} for k, x in w.a.items()}
    assert shard["q_proj"] == {(64, 8)} and shard["o_proj"] == {(16, 8)}
    shard = {k: {s.data.shape for s in x[1].addressable_shards} for k, x in w.b.items()}
    assert shard["q_proj"] == {(8, 16)} and shard["down_proj"] == {(8, 64)}
    assert shard["k_proj"] == {(8, 32)}  # K = 2 < tp: k_proj is replicated
    engine_helpers.check_clean(llm)


def test_engine_tp2_lora_splits_kv_adapters_with_their_heads(engine_params, tmp_path):
    """At tp = 2 the tiny preset's K = 2 kv heads are split, not replicated (as at tp = 4
    above): each adapter's k_proj and v_proj b are split over their outputs with them."""
    from lora_helpers import write_peft

    from pagedjax import lora

    cfg = engine_helpers.TINY
    write_peft(tmp_path / "a", cfg, rank=4, modules=lora.TARGET_MODULES, seed=3)
    req = lora.LoRARequest("a", 1, str(tmp_path / "a"))
    llm = LLM(
        engine_params,
        tensor_parallel=2,
        enable_lora=True,
        max_lora_rank=4,
        **engine_helpers.GEOMETRY,
    )
    prompts = engine_tests.prompts_with_shared_prefixes()[:3]
    outs = llm.generate(prompts, engine_helpers.greedy(6), lora_request=req)
    merged = lora.merge_adapter(engine_params, lora.load_adapter(req.lora_path, cfg))
    want = engine_helpers.Dense(merged).greedy(prompts, 6)
    assert [o.outputs[0].token_ids for o in outs] == want
    b = llm.lora.weights.b  # [S*R, K*D] = [4, 32]: 16 columns, one kv head, per device
    assert {s.data.shape for s in b["k_proj"][0].addressable_shards} == {(4, 16)}
    assert {s.data.shape for s in b["v_proj"][1].addressable_shards} == {(4, 16)}
    engine_helpers.check_clean(llm)


@pytest.mark.parametrize(
    "names", [("dp", "tp"), pytest.param(("tp", "dp"), marks=pytest.mark.slow)]
)
def test_a_mesh_with_a_second_axis_replicates_over_it(engine_params, engine_dense, names):
    """`check_mesh` accepts axes besides "tp" (replicated over): the model split 2 ways
    on a 2 x 2 mesh, whichever axis comes first, gives the one-device greedy tokens."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), names)
    llm = LLM(sharding.shard_params(engine_params, mesh), **engine_helpers.GEOMETRY)
    assert llm.tensor_parallel == 2
    for pool in llm.cache.k:  # K = 2 = tp: one kv head per device, on all four devices
        assert {s.data.shape[0] for s in pool.addressable_shards} == {1}
        assert len(pool.sharding.device_set) == 4
    prompts = engine_tests.prompts_with_shared_prefixes()[:3]
    outs = llm.generate(prompts, engine_helpers.greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == engine_dense.greedy(prompts, 6)
    engine_helpers.check_clean(llm)


@pytest.mark.slow
def test_sleep_level_2_then_weights_from_another_mesh_take_the_engines_placement(
    engine_params,
):
    """After sleep(level=2) a tp = 4 engine takes new weights sharded over another mesh
    (as a trainer's might be) or as host arrays, and places them as its own."""
    from pagedjax import model

    cfg = engine_helpers.TINY
    llm = LLM(engine_params, tensor_parallel=4, **engine_helpers.GEOMETRY)
    shardings = [x.sharding for x in jax.tree.leaves(llm.params)]
    prompts = engine_tests.prompts_with_shared_prefixes()[:3]
    new = engine_helpers.random_params(2)
    want = engine_helpers.Dense(new).greedy(prompts, 6)
    llm.sleep(level=2)
    llm.wake_up()
    other = sharding.make_mesh(2, cfg, devices=jax.devices()[6:8])
    llm.update_params(sharding.shard_params(new, other))
    assert [x.sharding for x in jax.tree.leaves(llm.params)] == shardings
    outs = llm.generate(prompts, engine_helpers.greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.update_params({k: np.asarray(v) for k, v in model.params_to_flat(new).items()})
    assert [x.sharding for x in jax.tree.leaves(llm.params)] == shardings
    engine_helpers.check_clean(llm)


def test_llm_plans_its_pages_on_the_device_its_weights_lie_on(engine_params, monkeypatch):
    """Weights put on a non-default device without a mesh: the engine keeps its cache
    there (`sharding.home_device`), so it sizes the cache from that device's free memory
    and reports that device's peak; it read the default device's before."""
    from pagedjax import engine, resources

    target = jax.devices()[3]
    params = jax.device_put(engine_params, target)
    seen = []

    def plan_num_pages(cfg, page_size, **kw):
        seen.append(kw["device"])
        return resources.plan_num_pages(cfg, page_size, **kw)

    def peak_device_memory(device=None):
        seen.append(device)
        return None

    monkeypatch.setattr(engine, "plan_num_pages", plan_num_pages)
    monkeypatch.setattr(engine, "peak_device_memory", peak_device_memory)
    geometry = {k: v for k, v in engine_helpers.GEOMETRY.items() if k != "num_pages"}
    llm = LLM(params, max_model_len=64, **geometry)
    assert {d for x in jax.tree.leaves(llm.cache) for d in x.devices()} == {target}
    llm.summary()
    assert seen == [target, target]
