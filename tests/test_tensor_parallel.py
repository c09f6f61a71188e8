"""pagedjax.sharding: layout rules and bad input here (one device); tp = 1, 2, 4, 8 in a
subprocess with 8 simulated CPU devices (tests/tp_cases.py), since
`XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before JAX starts."""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from pagedjax import decode, model, sharding
from pagedjax.config import PRESETS, CacheConfig, ModelConfig

ROOT = Path(__file__).resolve().parent.parent
TINY8 = ModelConfig(
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    hidden_size=64,
    intermediate_size=128,
    vocab_size=256,
    qkv_bias=True,
    o_bias=True,  # so that every-parameter checks see o_proj.bias too
    dtype="float32",
)


def _run_cases(*pytest_args: str) -> str:
    # XLA_FLAGS already holds conftest.py's -O0 (the cases check numerics and
    # partitioning, not codegen speed); the subprocess inherits it.
    flags = "--xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/tp_cases.py"]
    proc = subprocess.run(
        [*cmd, *pytest_args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert re.search(r"\d+ passed", out) and "failed" not in out, out[-8000:]
    return out


def test_tensor_parallel_on_eight_simulated_devices():
    """tp = 1, 2, 4, 8 (K = 2 and 8; Qwen3 norms + window + q/k/v and o_proj biases;
    an untied vocabulary tp does not divide) agree; cache shares; HLO collectives; the
    engine at tp = 4 and 2, LoRA, a mesh with a second axis (tests/tp_cases.py)."""
    _run_cases()


@pytest.mark.slow
def test_tensor_parallel_on_eight_simulated_devices_slow():
    """K = 8 at tp = 2 and 8; MQA (K = 1, head_dim 64) with an FP8 cache and a vocabulary
    tp = 8 does not divide; the Pallas kernels per shard; the engine at tp = 4 with beam
    search under preemption, and prompt logprobs scored in chunks; `scoring.score`;
    sleep(level=2) then weights from another mesh (tests/tp_cases.py)."""
    _run_cases("-m", "slow")


@pytest.mark.parametrize(
    "path,k,expected",
    [
        ("embed_tokens.embedding", 2, P(sharding.AXIS, None)),
        ("layers.0.self_attn.q_proj.kernel", 2, P(None, sharding.AXIS)),
        ("layers.0.self_attn.q_proj.bias", 2, P(sharding.AXIS)),
        ("layers.1.self_attn.k_proj.kernel", 8, P(None, sharding.AXIS)),
        ("layers.1.self_attn.k_proj.kernel", 2, P()),  # K < tp: replicated
        ("layers.1.self_attn.v_proj.bias", 2, P()),
        ("layers.1.self_attn.v_proj.bias", 4, P(sharding.AXIS)),
        ("layers.0.self_attn.o_proj.kernel", 2, P(sharding.AXIS, None)),
        ("layers.0.self_attn.o_proj.bias", 2, P()),  # added once, after the all-reduce
        ("layers.1.self_attn.o_proj.bias", 8, P()),
        ("layers.0.mlp.gate_proj.kernel", 2, P(None, sharding.AXIS)),
        ("layers.0.mlp.up_proj.kernel", 2, P(None, sharding.AXIS)),
        ("layers.0.mlp.down_proj.kernel", 2, P(sharding.AXIS, None)),
        ("layers.0.input_layernorm.scale", 2, P()),
        ("layers.0.self_attn.q_norm.scale", 8, P()),  # Qwen3: within a head, never split
        ("layers.1.self_attn.k_norm.scale", 2, P()),
        ("norm.scale", 2, P()),
        ("lm_head.kernel", 2, P(None, sharding.AXIS)),
    ],
)
def test_param_spec_rules(path, k, expected):
    cfg = dataclasses.replace(TINY8, num_kv_heads=k)
    assert sharding.param_spec(path, cfg, 4) == expected


def test_every_parameter_has_a_rule_and_vocab_falls_back_to_replicated():
    cfg = dataclasses.replace(TINY8, vocab_size=250)  # 4 does not divide 250
    for path in model.param_shapes(cfg):
        spec = sharding.param_spec(path, cfg, 4)
        if path in ("embed_tokens.embedding", "lm_head.kernel"):
            assert spec == P()
    with pytest.raises(ValueError, match="no tensor-parallel rule for parameter 'foo.bar'"):
        sharding.param_spec("foo.bar", cfg, 4)


def test_cache_kv_heads_replicates_when_fewer_kv_heads_than_devices():
    assert sharding.cache_kv_heads(TINY8, 1) == 2
    assert sharding.cache_kv_heads(TINY8, 2) == 2
    assert sharding.cache_kv_heads(TINY8, 8) == 8


@pytest.mark.parametrize("k,tp,per_device", [(2, 1, 2), (2, 2, 1), (2, 8, 1), (8, 2, 4), (8, 8, 1)])
def test_device_kv_config_sizes_one_devices_share(k, tp, per_device):
    cfg = dataclasses.replace(TINY8, num_kv_heads=k)
    assert sharding.device_kv_config(cfg, tp).num_kv_heads == per_device
    assert sharding.device_kv_config(cfg, tp).kv_bytes_per_token * k == (
        cfg.kv_bytes_per_token * per_device
    )


@pytest.mark.parametrize(
    "cfg_changes,tp,num_devices,match",
    [
        ({}, 3, 8, r"tensor_parallel=3 must divide the number of query heads, num_heads=8"),
        ({}, 16, 8, r"tensor_parallel=16 needs 16 devices, but only 8 are present"),
        ({}, 0, 8, r"tensor_parallel must be a positive int, got tensor_parallel=0"),
        ({}, 2.0, 8, r"tensor_parallel must be a positive int, got tensor_parallel=2.0"),
        ({}, True, 8, r"tensor_parallel must be a positive int, got tensor_parallel=True"),
        (
            {"num_heads": 12, "num_kv_heads": 3},
            2,
            8,
            r"tensor_parallel=2 must divide num_kv_heads=3 or be a multiple of it",
        ),
        ({"intermediate_size": 100}, 8, 8, r"tensor_parallel=8 must divide intermediate_size=100"),
    ],
)
def test_check_tensor_parallel_rejects_bad_sizes(cfg_changes, tp, num_devices, match):
    cfg = dataclasses.replace(TINY8, **cfg_changes)
    with pytest.raises(ValueError, match=match):
        sharding.check_tensor_parallel(cfg, tp, num_devices)


def test_more_devices_than_present_is_a_clear_error():
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"tensor_parallel={8 * n} needs {8 * n} devices"):
        sharding.make_mesh(8 * n, TINY8)
    with pytest.raises(ValueError, match=rf"needs {8 * n} devices, but only {n} are present"):
        sharding.make_mesh(8 * n)


def test_one_device_path_has_no_sharding_in_its_program():
    """Without a mesh the step is the single-device program: no shard_map, no shardings."""
    cfg = PRESETS["tiny"]
    params = model.init_params(cfg)
    cache_cfg = CacheConfig(page_size=4, num_pages=16, dtype=cfg.dtype)
    cache = sharding.create_cache(cfg, cache_cfg, None)
    assert params.mesh is None and cache.k[0].shape == (cfg.num_kv_heads, 16, 4, cfg.head_dim)
    inp = decode.build_step_input([decode.SeqChunk([1, 2, 3], 0, [1])], cfg, cache_cfg)
    text = decode._prefill_jit.lower(
        params,
        cache,
        inp,
        backend="xla",
        interpret=False,
        num_top_logprobs=0,
        return_logits=False,
    ).as_text()
    assert "manual_computation" not in text and "sharding" not in text


def _generate_script():
    spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts/generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "tp,match",
    [
        ("0", "--tensor-parallel must be >= 1, got 0"),
        (str(8 * jax.device_count()), f"needs {8 * jax.device_count()} devices, but only"),
    ],
)
def test_generate_script_rejects_bad_tensor_parallel(capsys, tp, match):
    rc = _generate_script().main(["--tensor-parallel", tp, "--prompt", "x", "--backend", "xla"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("error: ") and match in err and err.count("\n") == 1, err


def test_llm_rejects_more_devices_than_present_before_loading():
    from pagedjax.engine import LLM

    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"tensor_parallel={2 * n} needs {2 * n} devices"):
        LLM(TINY8, tensor_parallel=2 * n, backend="xla")
    with pytest.raises(ValueError, match=r"tensor_parallel must be a positive int"):
        LLM(TINY8, tensor_parallel=0, backend="xla")
