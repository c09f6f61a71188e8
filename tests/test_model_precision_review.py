"""The model's dots ask for float32 precision in a float32 model (pagedjax.model).

XLA's DEFAULT precision computes a float32 dot in TF32 on recent GPUs (10-bit mantissa,
~1e-3 relative) and in one bfloat16 pass on TPUs; HF's float32 model (torch does not use
TF32 for matmuls by default) and our float32 kernels compute in float32. The CPU computes
float32 either way, so these tests read the precision each dot is lowered with.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from pagedjax import model
from pagedjax.config import PRESETS

TINY = dataclasses.replace(PRESETS["tiny"], num_layers=1, tie_embeddings=False)


def dot_precisions(fn, *args) -> list[str]:
    """The `precision = [...]` of every dot_general in `fn`'s lowered StableHLO."""
    text = jax.jit(fn).lower(*args).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots, "no dot_general lowered"
    return [re.search(r"precision = \[([A-Z, ]+)\]", line).group(1) for line in dots]


@pytest.mark.parametrize("tied", [False, True])
def test_float32_model_lowers_every_dot_at_highest(tied):
    """q/k/v/o, the MLP, both attention einsums and the LM head (tied or not)."""
    cfg = dataclasses.replace(TINY, tie_embeddings=tied)
    params = model.init_params(cfg)
    precisions = dot_precisions(model.forward, params, jnp.zeros((1, 4), jnp.int32))
    # 4 attention projections + 2 einsums + 3 MLP projections per layer, and the head.
    assert len(precisions) == 9 * cfg.num_layers + 1
    assert set(precisions) == {"HIGHEST, HIGHEST"}, precisions
    head = dot_precisions(model.head_logits, params, jnp.zeros((2, cfg.hidden_size)))
    assert head == ["HIGHEST, HIGHEST"]


def test_bfloat16_model_keeps_default_precision():
    """bf16 operands are exact in TF32 or a bf16 pass: no slower dots for nothing."""
    cfg = dataclasses.replace(TINY, dtype="bfloat16")
    params = model.init_params(cfg)
    precisions = dot_precisions(model.forward, params, jnp.zeros((1, 4), jnp.int32))
    assert set(precisions) == {"DEFAULT, DEFAULT"}, precisions
