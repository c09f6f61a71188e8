"""`LoRASlots` (pagedjax/lora_engine.py) at its edges: weights a slot cannot hold are
refused before anything held changes, an adapter given from memory is held as it was
given, one directory reached through a symbolic link is the adapter it names, and
`pin_lora` keeps an adapter read for a request. The engine's LoRA serving is tested in
tests/test_lora_engine.py.
"""

import dataclasses
import os

import numpy as np
import pytest
from engine_helpers import GEOMETRY, TINY, greedy, random_params
from lora_helpers import write_peft

from pagedjax import lora
from pagedjax.engine import LLM
from pagedjax.lora_engine import LoRASlots


def _slots(cfg=TINY, *, max_loras=1, max_cpu_loras=0, in_use=frozenset()):
    return LoRASlots(cfg, max_loras, 4, max_cpu_loras, None, lambda: set(in_use))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    write_peft(root / "a", TINY, rank=4, alpha=8, seed=11)
    # lora_alpha / r = 1e6: b * scaling is ~3e5, past float16's 65504.
    write_peft(root / "loud", TINY, rank=1, alpha=1e6, modules=("q_proj",), seed=12)
    return root


def test_weights_not_finite_in_the_models_dtype_are_refused_and_nothing_changes(root):
    """A NaN or infinity in any slot makes every row of a step NaN, whatever its adapter
    (a token's zero mask times it), so such weights never reach a slot: from memory,
    or from disk with a scaling that overflows the model's dtype; the adapters held stay
    as they were, the one under the refused id too."""
    good = lora.LoRARequest("a", 1, str(root / "a"))
    loud = lora.LoRARequest("loud", 2, str(root / "loud"))
    half = _slots(dataclasses.replace(TINY, dtype="float16"))
    assert half.add(good, pin=True)
    with pytest.raises(ValueError, match="'.*loud': layer 0 q_proj: .* dtype float16"):
        half.add(loud)
    assert set(half.requests) == {1} and half.pinned == {1}
    assert _slots().add(loud)  # (float32 holds it)

    slots = _slots()
    assert slots.add(good, pin=True)
    key = slots.cache_key(1)
    held = lora.load_adapter(good.lora_path, TINY)
    for bad, ab in ((np.nan, 1), (np.inf, 1), (np.nan, 0), (-np.inf, 0)):
        weights = {k: (a.copy(), b.copy()) for k, (a, b) in held.weights.items()}
        weights[1, "v_proj"][ab][0, 0] = bad
        adapter = lora.LoRAAdapter(weights, held.rank)
        with pytest.raises(ValueError, match="'a': layer 1 v_proj: .* not all finite"):
            slots.add(good, adapter=adapter, pin=True)
        assert set(slots.requests) == {1} and slots.pinned == {1}
        assert slots.cache_key(1) == key


def test_an_adapter_from_memory_is_held_as_it_was_given(root):
    """The caller's arrays changed in place after `add` (an RL loop's optimizer step)
    do not change the weights a slot gets: those given, which the adapter's prefix-cache
    key stands for."""
    held = lora.load_adapter(str(root / "a"), TINY)
    weights = {k: (a.copy(), b.copy()) for k, (a, b) in held.weights.items()}
    slots = _slots()
    request = lora.LoRARequest("policy", 7, "policy")
    assert slots.add(request, adapter=lora.LoRAAdapter(weights, held.rank), pin=True)
    for a, b in weights.values():
        a *= 2.0
        b[:] = 0.0
    assert slots.prepare({7}) == {0: 0, 7: 1}
    got_a, got_b = slots.weights.stacked("q_proj")
    want_a, want_b = held.weights[0, "q_proj"]
    np.testing.assert_array_equal(got_a[0], want_a)
    np.testing.assert_allclose(got_b[0], want_b, rtol=1e-6)


def test_a_directory_reached_through_a_symlink_is_the_adapter_it_names(root, tmp_path):
    """The same directory under another spelling (here a symbolic link) is the adapter
    held under the id, as `dir/.` is; another directory is refused."""
    os.symlink(root / "a", tmp_path / "link")
    slots = _slots()
    assert slots.add(lora.LoRARequest("a", 1, str(root / "a")))
    assert slots.add(lora.LoRARequest("a", 1, str(tmp_path / "link"))) is False
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter"):
        slots.add(lora.LoRARequest("a", 1, str(root / "loud")))


def test_pin_lora_keeps_an_adapter_read_for_a_request(root):
    """vLLM's `pin_lora`: an adapter held (here read for a request, then spare) stays on
    the host when reading another would push it out; unknown ids are refused."""
    llm = LLM(random_params(0), **GEOMETRY, enable_lora=True, max_loras=1, max_cpu_loras=0)
    good = lora.LoRARequest("a", 1, str(root / "a"))
    with pytest.raises(ValueError, match="LoRA adapter 1 is not held"):
        llm.pin_lora(1)
    with pytest.raises(TypeError, match="lora_id must be an int"):
        llm.pin_lora(True)
    llm.abort(llm.add_request([5, 6, 7], greedy(2), lora_request=good))
    assert llm.pin_lora(1) is True
    for i in (2, 3):  # (the same directory under two ids: two adapters)
        other = lora.LoRARequest(f"l{i}", i, str(root / "loud"))
        llm.abort(llm.add_request([5, 6], greedy(2), lora_request=other))
    assert llm.list_loras() == {1, 3}  # 2 made room for 3; 1 is pinned
    assert llm.remove_lora(1) and llm.list_loras() == {3}
    plain = LLM(random_params(0), **GEOMETRY)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.pin_lora(1)
