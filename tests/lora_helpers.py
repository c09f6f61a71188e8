"""PEFT LoRA adapter directories written by hand, as PEFT's `save_pretrained` writes them:
`adapter_config.json` and `adapter_model.safetensors` with `A` `[r, in]` and `B`
`[out, r]` under `base_model.model.model.layers.{i}.{block}.{module}.lora_{A,B}.weight`.
"""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from pagedjax import lora

# (The names and shapes come from pagedjax.lora; tests/test_lora.py checks them against
# the model's parameters.)
BLOCKS = lora.TARGET_MODULES
dims = lora.module_dims


def write_peft(
    path,
    cfg,
    *,
    rank=4,
    alpha=8,
    modules=tuple(BLOCKS),
    layers=None,
    seed=0,
    scale=0.3,
    config=None,
    tensors=None,
):
    """Writes a random adapter; returns {(layer, module): (A [r, in], B [out, r])}.

    `config` updates adapter_config.json; `tensors` updates the safetensors dict (a
    value None drops the key).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    layers = range(cfg.num_layers) if layers is None else layers
    weights, out = {}, {}
    for layer in layers:
        for m in modules:
            n_in, n_out = dims(cfg, m)
            a = (rng.standard_normal((rank, n_in)) * scale).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * scale).astype(np.float32)
            key = f"base_model.model.model.layers.{layer}.{BLOCKS[m]}.{m}"
            weights[f"{key}.lora_A.weight"], weights[f"{key}.lora_B.weight"] = a, b
            out[layer, m] = (a, b)
    for k, v in (tensors or {}).items():
        if v is None:
            weights.pop(k, None)
        else:
            weights[k] = v
    save_file(weights, str(path / "adapter_model.safetensors"))
    conf = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "task_type": "CAUSAL_LM",
    }
    conf.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return out
