"""LLM(enable_lora=True): requests of several adapters (and of none) batched together give
what the dense model with each adapter merged into its weights gives; adapters wait for a
device slot, never share prefix-cache pages, and a bad adapter is refused before anything
is queued. The adapter format and the step's update are tested in tests/test_lora.py.
"""

import dataclasses
import shutil

import numpy as np
import pytest
from engine_helpers import GEOMETRY, TINY, Dense, check_clean, greedy, random_params
from lora_helpers import write_peft

from pagedjax import lora, lora_engine, resources
from pagedjax.beam_search import BeamSearchParams
from pagedjax.engine import LLM, SamplingParams
from pagedjax.tokenizer import Tokenizer

RANK = 4


@pytest.fixture(scope="module")
def params():
    return random_params(0)


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    write_peft(root / "a", TINY, rank=4, alpha=8, seed=11)
    write_peft(root / "b", TINY, rank=2, alpha=2, modules=("q_proj", "v_proj", "up_proj"), seed=12)
    write_peft(root / "c", TINY, rank=3, alpha=6, modules=("o_proj", "down_proj"), seed=13)
    write_peft(root / "d", TINY, rank=1, alpha=1, modules=("k_proj",), seed=15)
    write_peft(root / "wide", TINY, rank=8, modules=("q_proj",), seed=14)
    reqs = {n: lora.LoRARequest(n, i, str(root / n)) for i, n in enumerate("abcd", start=1)}
    reqs["wide"] = lora.LoRARequest("wide", 9, str(root / "wide"))
    return reqs


@pytest.fixture(scope="module")
def dense(params, loras):
    """Dense references: the base model and each adapter merged into it."""
    out = {None: Dense(params)}
    for n in "abc":
        out[n] = Dense(lora.merge_adapter(params, lora.load_adapter(loras[n].lora_path, TINY)))
    return out


def _llm(params, **kw):
    args = dict(GEOMETRY, enable_lora=True, max_loras=2, max_lora_rank=RANK)
    return LLM(params, **{**args, **kw})


def _prompts(n, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, TINY.vocab_size, int(rng.integers(3, 20))).tolist() for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mixed_adapters_match_their_merged_models(params, loras, dense, async_scheduling):
    """Nine requests over three adapters and the base model, two slots: every completion
    equals the dense greedy one of its adapter merged into the weights, and no step ran
    more than two distinct adapters."""
    llm = _llm(params, async_scheduling=async_scheduling)
    names = ["a", None, "b", "c", "a", "c", None, "b", "a"]
    prompts = _prompts(len(names))
    seen = []

    def watch(engine):
        seen.append({g.lora_id for g in engine.scheduler.running} - {0})

    outs = llm.generate(
        prompts,
        greedy(6),
        lora_request=[loras[n] if n else None for n in names],
        on_step=watch,
    )
    for p, n, o in zip(prompts, names, outs, strict=True):
        assert o.outputs[0].token_ids == dense[n].greedy([p], 6)[0], n
        assert o.lora_request == (loras[n] if n else None)
    assert max(map(len, seen)) == 2 and set().union(*seen) == {1, 2, 3}
    base = dense[None].greedy(prompts[:1], 6)[0]  # (the adapters do change the outputs)
    assert outs[0].outputs[0].token_ids != base
    check_clean(llm)
    assert llm.list_loras() == {1, 2, 3}  # (max_cpu_loras defaults to max_loras: 2 spare + ...)


def test_prefix_cache_pages_are_per_adapter(params, loras, dense):
    llm = _llm(params)
    prompt = _prompts(1, seed=5)[0] * 3  # 3+ pages
    runs = [("a", True), ("b", False), (None, False), ("a", True), ("b", True), (None, True)]
    for i, (n, _) in enumerate(runs):
        (o,) = llm.generate([prompt], greedy(3), lora_request=loras[n] if n else None)
        assert o.outputs[0].token_ids == dense[n].greedy([prompt], 3)[0]
        cached = o.num_cached_tokens > 0
        first = all(m != n for m, _ in runs[:i])
        assert cached == (not first), (i, n, o.num_cached_tokens)
    check_clean(llm)


def test_beam_search_and_chat_take_a_lora_request(params, loras, dense):
    tok = Tokenizer(
        resources.byte_tokenizer().tokenizer,
        bos_token_id=1,
        eos_token_ids=[2],
        chat_template="{% for m in messages %}<{{ m['content'] }}>{% endfor %}",
    )
    llm = _llm(params, tokenizer=tok)
    (out,) = llm.chat([{"role": "user", "content": "hi"}], greedy(5), lora_request=loras["c"])
    assert out.lora_request == loras["c"]
    want = dense["c"].greedy([out.prompt_token_ids], 5)[0]
    assert out.outputs[0].token_ids == want != dense[None].greedy([out.prompt_token_ids], 5)[0]
    merged = LLM(dense["a"].params, **GEOMETRY)
    prompts = _prompts(2, seed=8)
    bp = BeamSearchParams(beam_width=3, max_tokens=4)
    got = llm.beam_search(prompts, bp, lora_request=loras["a"])
    want = merged.beam_search(prompts, bp)
    for g, w in zip(got, want, strict=True):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        np.testing.assert_allclose(
            [s.cum_logprob for s in g.sequences], [s.cum_logprob for s in w.sequences], rtol=1e-4
        )
    check_clean(llm)


def test_adapters_wait_for_a_slot_and_the_host_keeps_max_cpu_loras(params, loras, dense):
    llm = _llm(params, max_loras=1, max_cpu_loras=0)
    assert llm.add_lora(loras["c"]) is True and llm.add_lora(loras["c"]) is False
    ids = [
        llm.add_request(p, greedy(4), lora_request=loras[n])
        for p, n in zip(_prompts(3, 9), "aba", strict=True)
    ]
    running = []
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o
        running.append({g.lora_id for g in llm.scheduler.running})
    assert all(len(r - {0}) <= 1 for r in running)
    for rid, p, n in zip(ids, _prompts(3, 9), "aba", strict=True):
        assert outs[rid].outputs[0].token_ids == dense[n].greedy([p], 4)[0]
    assert llm.list_loras() == {1, 2, 3}  # (nothing needed the room yet)
    llm.generate(_prompts(1, 10), greedy(2), lora_request=loras["d"])
    assert llm.list_loras() == {3, 4}  # a and b made room for d; c is pinned
    assert llm.remove_lora(3) is True and llm.remove_lora(3) is False
    assert llm.list_loras() == {4}
    check_clean(llm)


def test_generate_reads_each_new_adapter_once(params, loras, dense, monkeypatch):
    """Adapters read while `generate` validates its prompts are spare until queued: with
    no room for spare ones, each pushed the one before out and was read again."""
    reads = []
    load = lora_engine.load_adapter

    def counted(path, *args, **kwargs):
        reads.append(path)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(lora_engine, "load_adapter", counted)
    llm = _llm(params, max_loras=1, max_cpu_loras=0)
    prompts = _prompts(3, 11)
    outs = llm.generate(prompts, greedy(3), lora_request=[loras[n] for n in "abc"])
    assert reads == [loras[n].lora_path for n in "abc"]
    for o, p, n in zip(outs, prompts, "abc", strict=True):
        assert o.outputs[0].token_ids == dense[n].greedy([p], 3)[0]
    assert llm.list_loras() == {1, 2, 3}  # (nothing needed the room yet)
    llm.generate(prompts[:1], greedy(1), lora_request=loras["d"])
    assert llm.list_loras() == {4} and len(reads) == 4


def test_a_refused_request_leaves_no_adapter_held(params, loras):
    llm = _llm(params)
    rid = llm.add_request([5, 6, 7], greedy(2))
    with pytest.raises(ValueError, match="already"):  # the id is taken
        llm.add_request([5, 6], greedy(2), request_id=rid, lora_request=loras["a"])
    with pytest.raises(ValueError, match="n=100"):  # more samples than seats
        llm.add_request([5, 6], SamplingParams(n=100, max_tokens=2), lora_request=loras["b"])
    assert llm.list_loras() == set()
    llm.abort(rid)
    # Nor does it push a spare adapter out of the host cache (max_cpu_loras=0: the one
    # read for an aborted request stays until another is read for a queued request).
    llm = _llm(params, max_cpu_loras=0)
    llm.abort(llm.add_request([5, 6], greedy(2), lora_request=loras["a"]))
    assert llm.list_loras() == {1}
    rid = llm.add_request([5, 6, 7], greedy(2))
    with pytest.raises(ValueError, match="already"):
        llm.add_request([5, 6], greedy(2), request_id=rid, lora_request=loras["b"])
    assert llm.list_loras() == {1}
    llm.abort(rid)


def test_bad_adapters_and_arguments_are_refused_before_queueing(params, loras, tmp_path):
    llm = _llm(params)
    with pytest.raises(ValueError, match="has rank 8 > max_lora_rank=4"):
        llm.add_request([5, 6, 7], greedy(2), lora_request=loras["wide"])
    missing = lora.LoRARequest("x", 5, str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llm.generate([[5, 6], [7, 8]], greedy(2), lora_request=[None, missing])
    other_path = lora.LoRARequest("a2", 1, loras["b"].lora_path)
    llm.add_lora(loras["a"])
    with pytest.raises(
        ValueError, match="lora_int_id 1 is adapter .* give each adapter its own id"
    ):
        llm.add_request([5, 6], greedy(2), lora_request=other_path)
    with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], greedy(2), lora_request=[loras["a"]])
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.generate([[5, 6]], greedy(2), lora_request="a")
    assert not llm.has_unfinished_requests() and llm.list_loras() == {1}
    # (the same directory spelled another way is the same adapter)
    assert llm.add_lora(lora.LoRARequest("a", 1, loras["a"].lora_path + "/.")) is False
    rid = llm.add_request([5, 6], greedy(2), lora_request=loras["a"])
    with pytest.raises(ValueError, match="LoRA adapter 1 is in use"):
        llm.remove_lora(1)
    llm.abort(rid)
    for bad in (True, "1", 1.0):
        with pytest.raises(TypeError, match="lora_id must be an int"):
            llm.remove_lora(bad)
    assert llm.list_loras() == {1}
    plain = LLM(params, **GEOMETRY)
    with pytest.raises(ValueError, match=r"LoRA is not enabled: .*enable_lora=True"):
        plain.generate([[5, 6]], greedy(2), lora_request=loras["a"])
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.list_loras()
    for kw, match in (
        (dict(enable_lora="yes"), "enable_lora must be a bool"),
        (dict(enable_lora=True, max_loras=0), "max_loras must be a positive int"),
        (dict(enable_lora=True, max_lora_rank=2.0), "max_lora_rank must be a positive int"),
        (dict(enable_lora=True, max_cpu_loras=-1), "max_cpu_loras must be None or an int >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            LLM(TINY, **GEOMETRY, **kw)


def test_sleep_and_wake_up_keep_the_adapters(params, loras, dense):
    llm = _llm(params)
    prompt = _prompts(1, seed=12)[0]
    (before,) = llm.generate([prompt], greedy(4), lora_request=loras["b"])
    llm.sleep(level=1)
    llm.wake_up()
    (after,) = llm.generate([prompt], greedy(4), lora_request=loras["b"])
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert after.outputs[0].token_ids == dense["b"].greedy([prompt], 4)[0]


def test_steps_without_adapters_run_the_base_models_program(params, loras, dense):
    """A step with no adapter row skips LoRA (no slots prepared, the base program) and
    gives the base engine's tokens; adapter rows in a step bring the LoRA path back."""
    llm = _llm(params)
    calls = []
    prepare = llm.lora.prepare
    llm.lora.prepare = lambda ids: calls.append(set(ids)) or prepare(ids)
    prompts = _prompts(3, seed=21)
    outs = llm.generate(prompts, greedy(5))
    assert not calls
    assert [o.outputs[0].token_ids for o in outs] == dense[None].greedy(prompts, 5)
    (out,) = llm.generate(prompts[:1], greedy(5), lora_request=loras["a"])
    assert calls and all(c == {1} for c in calls)
    assert out.outputs[0].token_ids == dense["a"].greedy(prompts[:1], 5)[0]


def test_new_weights_for_an_id_never_reuse_the_old_ones_pages(params, loras, dense, tmp_path):
    """An RL loop's update: `add_lora(request, adapter=...)` gives an id new weights
    from memory; the next requests run with them and miss the prefix cache the old ones
    filled (then hit their own). So does an id removed and read again from another path."""
    llm = _llm(params)
    policy = lora.LoRARequest("policy", 7, "policy")  # (from memory: the path only names it)
    prompt = _prompts(1, seed=30)[0] * 3
    for name in ("a", "c", "c"):
        adapter = lora.load_adapter(loras[name].lora_path, TINY)
        state = {
            f"model.layers.{layer}.{lora.TARGET_MODULES[m]}.{m}.lora_{x}.weight": w
            for (layer, m), (a, b) in adapter.weights.items()
            for x, w in (("A", a.T), ("B", b.T))
        }  # (scaling folded in b: lora_alpha = r keeps it)
        conf = {"r": adapter.rank, "lora_alpha": adapter.rank}
        assert llm.add_lora(policy, adapter=lora.adapter_from_state(state, conf, TINY))
        for hit in (False, True):
            (o,) = llm.generate([prompt], greedy(3), lora_request=policy)
            assert o.outputs[0].token_ids == dense[name].greedy([prompt], 3)[0]
            assert (o.num_cached_tokens > 0) == hit, (name, hit)
    rid = llm.add_request(prompt, greedy(3), lora_request=policy)
    with pytest.raises(ValueError, match="LoRA adapter 7 is in use"):
        llm.add_lora(policy, adapter=lora.load_adapter(loras["a"].lora_path, TINY))
    llm.abort(rid)
    (o,) = llm.generate([prompt], greedy(3), lora_request=loras["b"])
    assert llm.remove_lora(2)
    other = lora.LoRARequest("b2", 2, loras["a"].lora_path)
    (o,) = llm.generate([prompt], greedy(3), lora_request=other)
    assert o.outputs[0].token_ids == dense["a"].greedy([prompt], 3)[0] and not o.num_cached_tokens
    check_clean(llm)


def test_an_adapter_from_memory_must_fit_the_model(params, loras, dense):
    """Weights built for another model are refused by add_lora (and merge_adapter),
    naming the misfit, and leave the adapter held under the id as it was (not a failure
    in a later step)."""
    llm = _llm(params)
    policy = lora.LoRARequest("policy", 7, "policy")
    assert llm.add_lora(policy, adapter=lora.load_adapter(loras["a"].lora_path, TINY))
    prompt = _prompts(1, seed=33)[0]
    other = dataclasses.replace(TINY, num_layers=3, intermediate_size=96)
    rng = np.random.default_rng(0)
    for layer, match in ((2, "layer 2 is not in the model's 2 layers"), (1, "do not fit")):
        state = {}
        for m, block in lora.TARGET_MODULES.items():
            n_in, n_out = lora.module_dims(other, m)
            key = f"model.layers.{layer}.{block}.{m}"
            state[f"{key}.lora_A.weight"] = rng.standard_normal((2, n_in)).astype(np.float32)
            state[f"{key}.lora_B.weight"] = rng.standard_normal((n_out, 2)).astype(np.float32)
        bad = lora.adapter_from_state(state, {"r": 2}, other)
        with pytest.raises(ValueError, match=f"LoRA adapter 'policy': .*{match}"):
            llm.add_lora(policy, adapter=bad)
        with pytest.raises(ValueError, match=f"LoRA adapter: .*{match}"):
            lora.merge_adapter(params, bad)
        assert llm.list_loras() == {7}
        (o,) = llm.generate([prompt], greedy(4), lora_request=policy)
        assert o.outputs[0].token_ids == dense["a"].greedy([prompt], 4)[0]
    liar = lora.LoRAAdapter(lora.load_adapter(loras["b"].lora_path, TINY).weights, rank=1)
    with pytest.raises(ValueError, match="rank=1, but its modules' largest rank is 2"):
        llm.add_lora(policy, adapter=liar)
    check_clean(llm)


def test_an_adapter_changed_on_disk_is_not_served_from_the_old_ones_pages(
    params, loras, dense, tmp_path
):
    """An adapter forgotten on the host (max_cpu_loras) and read again from its directory
    after the files changed (a retrained adapter saved over the old one) runs with the new
    weights and misses the prefix-cache pages of the old ones; read again unchanged, it
    finds its own pages."""
    llm = _llm(params, max_cpu_loras=0)
    path = tmp_path / "v"
    req = lora.LoRARequest("v", 8, str(path))
    prompt = _prompts(1, seed=40)[0] * 3
    for name, hit in (("a", False), ("c", False), ("a", True)):
        shutil.copytree(loras[name].lora_path, path, dirs_exist_ok=True)
        (o,) = llm.generate([prompt], greedy(3), lora_request=req)
        assert o.outputs[0].token_ids == dense[name].greedy([prompt], 3)[0], name
        assert (o.num_cached_tokens > 0) == hit, (name, o.num_cached_tokens)
        llm.generate([prompt[:4]], greedy(1), lora_request=loras["d"])  # forgets v
        assert 8 not in llm.list_loras()
    check_clean(llm)
