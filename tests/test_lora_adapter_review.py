"""pagedjax.lora: adapter_config.json fields that change what PEFT's loaded model computes
are honoured or refused by name (review of the PEFT adapter reader)."""

import numpy as np
import pytest
from lora_helpers import write_peft

from pagedjax import lora
from pagedjax.config import PRESETS

TINY = PRESETS["tiny"]


# PEFT's LoraLayer.update_layer runs the config's init_lora_weights whenever it builds the
# layer, loading a saved adapter included: PiSSA, OLoRA, CorDA and LoftQ then rewrite the
# base weight (W - scaling * B0 @ A0, or LoftQ's quantized W), so PEFT's model is not
# W + scaling * B @ A. vLLM drops the field (PEFTHelper.from_dict keeps only its own).
@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq"])
def test_inits_that_rewrite_the_base_weights_are_refused(tmp_path, init):
    conf = {"init_lora_weights": init}
    write_peft(tmp_path / "a", TINY, rank=2, modules=("q_proj",), config=conf)
    match = f"init_lora_weights='{init}' is not supported"
    with pytest.raises(ValueError, match=match):
        lora.load_adapter(tmp_path / "a", TINY)
    a = np.zeros((2, 64), np.float32)
    state = {
        "model.layers.0.self_attn.q_proj.lora_A.weight": a,
        "model.layers.0.self_attn.q_proj.lora_B.weight": a.T,
    }
    with pytest.raises(ValueError, match=match):
        lora.adapter_from_state(state, {"r": 2, **conf}, TINY)


@pytest.mark.parametrize("init", [True, False, None, "gaussian", "eva", "orthogonal"])
def test_inits_that_leave_the_base_weights_load_as_peft_computes(tmp_path, init):
    raw = write_peft(
        tmp_path / "a",
        TINY,
        rank=2,
        alpha=6,
        modules=("v_proj",),
        config={"init_lora_weights": init},
    )
    ad = lora.load_adapter(tmp_path / "a", TINY)
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    for key, (a, b) in raw.items():
        wa, wb = ad.weights[key]
        np.testing.assert_allclose(x @ wa @ wb, (x @ a.T @ b.T) * 3.0, rtol=1e-5, atol=1e-5)


# load_adapter and adapter_from_state refuse weights that are not floating point; an
# adapter built in memory (LLM.add_lora(..., adapter=...)) is checked by check_adapter
# alone, and casting complex weights to float drops their imaginary part.
@pytest.mark.parametrize("dtype", [np.complex64, np.bool_])
def test_check_adapter_refuses_weights_that_are_not_floating_point(dtype):
    a, b = np.ones((64, 2), dtype), np.ones((2, 64), np.float32)
    for weights in ({(0, "q_proj"): (a, b)}, {(0, "q_proj"): (b.T, a.T)}):
        adapter = lora.LoRAAdapter(weights, 2)
        with pytest.raises(ValueError, match="layer 0 q_proj: [ab] has dtype .*floating point"):
            lora.check_adapter(adapter, TINY)
    ok = np.ones((64, 2), np.float16), np.ones((2, 64), np.float64)
    lora.check_adapter(lora.LoRAAdapter({(0, "q_proj"): ok}, 2), TINY)


def test_merge_adapter_keeps_the_mesh_of_tensor_parallel_params(tmp_path):
    """An engine's params carry their mesh (`Params.mesh`): merging into them gives params
    on that mesh, each array split as before (the merged ones were left on one device and
    the mesh dropped, so that at tp = 2 `LLM(merged)` refused the mixed params). A
    one-device "tp" mesh shows it here; tests/tp_cases.py runs the engine at tp > 1."""
    import jax
    from jax.sharding import Mesh
    from params_helpers import random_params

    from pagedjax import model, sharding

    params = random_params(TINY, seed=0)
    write_peft(tmp_path / "a", TINY, rank=2, seed=1)
    adapter = lora.load_adapter(tmp_path / "a", TINY)
    split = sharding.shard_params(params, Mesh(np.array(jax.devices()[:1]), (sharding.AXIS,)))
    merged = lora.merge_adapter(split, adapter)
    assert merged.mesh is split.mesh
    before, after = model.params_to_flat(split), model.params_to_flat(merged)
    for key, x in after.items():
        assert x.sharding == before[key].sharding, key
    want = model.params_to_flat(lora.merge_adapter(params, adapter))
    for key, x in after.items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want[key]), err_msg=key)
