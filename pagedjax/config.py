"""Model and cache configuration: frozen, hashable dataclasses (safe as jit static args).

`ModelConfig.from_hf(config_dict)` reads a HuggingFace `config.json` of the Llama
family (Llama 2/3/3.1/3.2, Qwen2, Qwen3 (dense), Mistral, with or without a sliding
window on every layer; the rules are in `pagedjax.hf_config`); `PRESETS` names a few
well-known shapes. Variants are made with `dataclasses.replace`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass, field, fields

import jax.numpy as jnp
import numpy as np

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}
# KV cache storage only: FP8 pages (half of bf16's bytes), written without scales,
# clipped to the format's range (`cache.to_storage`); the kernels upcast them.
_KV_DTYPES = {**_DTYPES, "float8_e4m3fn": jnp.float8_e4m3fn}
_DTYPE_ALIASES = {
    "f32": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
}


def dtype_name(dtype, *, kv: bool = False) -> str:
    """Canonical name of a dtype given as a string, numpy or jnp dtype.

    Args:
      dtype: e.g. "bf16", "bfloat16", jnp.bfloat16.
      kv: also accept the KV-cache-only dtypes ("fp8" = "float8_e4m3fn").
    """
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype, dtype)
    else:
        name = np.dtype(dtype).name
    known = _KV_DTYPES if kv else _DTYPES
    if name not in known:
        raise ValueError(f"dtype must be one of {sorted(known)}, got {dtype!r}")
    return name


def dtype_size(dtype) -> int:
    """Bytes per element of a dtype given by name or object (KV dtypes included)."""
    return np.dtype(_KV_DTYPES[dtype_name(dtype, kv=True)]).itemsize


# Which parameters each rope_type takes (HF's names): (required, optional). The other
# fields of a RopeScaling must be None for that type.
ROPE_SCALING_PARAMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "llama3": (
        ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
        (),
    ),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
    ),
}
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}  # HF's and the paper's


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as HF's `rope_scaling` dict: a kind and its parameters.

    Kinds (`rope_type`) and what they change (`pagedjax.rope.rope_frequencies` and
    `rope_attention_factor` compute them as HF's `modeling_rope_utils` does):

    * "linear": every inverse frequency divided by `factor` (position interpolation).
    * "llama3": frequencies with wavelength above `original_max_position_embeddings /
      low_freq_factor` divided by `factor`, below `original / high_freq_factor` kept,
      interpolated in between (Llama 3.1+).
    * "yarn": frequencies turning more than `beta_fast` times over the original
      context (`original_max_position_embeddings`) kept, fewer than `beta_slow` times
      divided by `factor`, a linear ramp between (`truncate`: its ends rounded out to
      whole dimensions); cos and sin multiplied by an attention factor
      (`attention_factor`, else derived from `factor`, `mscale` and `mscale_all_dim`).
      Absent `beta_fast`, `beta_slow` and `truncate` take HF's defaults 32, 1 and True.

    Fields a kind does not take must be None (`ROPE_SCALING_PARAMS`); values are
    checked here: `factor` and the lengths positive, `high_freq_factor >
    low_freq_factor`, `beta_fast >= beta_slow > 0`, ...; ValueError names a bad one.
    """

    rope_type: str
    factor: float
    _: KW_ONLY
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None

    def __post_init__(self):
        kind = self.rope_type
        if kind not in ROPE_SCALING_PARAMS:
            raise ValueError(
                f"rope_type must be one of {sorted(ROPE_SCALING_PARAMS)}, got rope_type={kind!r}"
            )
        if kind == "yarn":
            for name, default in _YARN_DEFAULTS.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
        required, optional = ROPE_SCALING_PARAMS[kind]
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rope_type"}
        takes = required + optional
        extra = [f"{k}={v!r}" for k, v in values.items() if v is not None and k not in takes]
        if extra:
            raise ValueError(
                f"rope_scaling {kind!r} takes only {list(takes)}, got {', '.join(extra)}"
            )
        missing = [k for k in required if values[k] is None]
        if missing:
            raise ValueError(f"rope_scaling {kind!r} needs {missing}")
        for name, value in values.items():
            if value is not None:
                object.__setattr__(self, name, _rope_param(kind, name, value))
        if kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "rope_scaling 'llama3': high_freq_factor must exceed low_freq_factor, got "
                f"high_freq_factor={self.high_freq_factor}, low_freq_factor={self.low_freq_factor}"
            )
        if kind == "yarn" and self.beta_fast < self.beta_slow:
            raise ValueError(
                "rope_scaling 'yarn': beta_fast must be at least beta_slow, got "
                f"beta_fast={self.beta_fast}, beta_slow={self.beta_slow}"
            )


def _rope_param(kind: str, name: str, value):
    """A RopeScaling field's value as its type (float, int or bool); ValueError naming it."""
    if name == "truncate":
        ok, what, cast = isinstance(value, (bool, np.bool_)), "a bool", bool
    elif name == "original_max_position_embeddings":
        ok = is_finite_number(value) and value == int(value) and value > 0
        what, cast = "a positive int", int
    elif name in ("mscale", "mscale_all_dim"):  # 0 means "not set" in HF's mscale rule
        ok, what, cast = is_finite_number(value) and value >= 0, "a number >= 0", float
    else:  # factors and betas divide, or take the log of, something
        ok, what, cast = is_finite_number(value) and value > 0, "a positive number", float
    if not ok:
        raise ValueError(f"rope_scaling {kind!r}: {name} must be {what}, got {name}={value!r}")
    return cast(value)


def is_finite_number(x) -> bool:
    """A finite real number; bools are not (JSON's true is no factor), nor an int too big
    for a float (math.isfinite raises OverflowError for it)."""
    number = isinstance(x, (int, float, np.integer, np.floating))
    try:
        return number and not isinstance(x, (bool, np.bool_)) and math.isfinite(x)
    except OverflowError:
        return False


def is_int(v) -> bool:
    """A Python or numpy integer, not a bool (True would read as 1)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_token_id(v) -> bool:
    """A token id's type: a Python or numpy int, or a JAX integer scalar (what
    `operator.index` takes); not a bool (True would read as 1) nor a float."""
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (int, np.integer)):
        return True
    if not hasattr(type(v), "__index__"):
        return False
    try:
        operator.index(v)
    except TypeError:  # (an array of more than one element, or of floats)
        return False
    return True


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Attributes:
      num_layers: decoder blocks (L).
      num_heads: query heads (H).
      num_kv_heads: key/value heads (K); must divide num_heads.
      head_dim: per-head width (D).
      hidden_size: residual width (E).
      intermediate_size: SwiGLU hidden width.
      vocab_size: V.
      max_position_embeddings: longest sequence the model accepts.
      rope_theta: RoPE base, a number > 1.
      rope_scaling: RoPE frequency scaling ("linear", "llama3" or "yarn"), or None.
      norm_eps: RMSNorm epsilon, a number >= 0.
      tie_embeddings: LM head shares the embedding matrix.
      qkv_bias: biases on the q/k/v projections (Qwen2; Llama and Qwen3 with
        `attention_bias`).
      o_bias: a bias on the output projection o_proj (Llama and Qwen3 with
        `attention_bias`, which biases q/k/v and o together; Qwen2 biases q/k/v only).
        Needs `qkv_bias`, and with `qk_norm` equals it: no HF family has another mix.
      qk_norm: per-head RMSNorm (over D, eps norm_eps) on queries and keys after the
        projections and before RoPE (Qwen3).
      sliding_window: W: a query at position p attends only to keys j with
        p - W < j <= p (W keys, itself included), in every layer (Mistral-7B-v0.1);
        None: full causal attention. The engine gives back pages that fall out of
        every later query's window (`BlockManager.release_before`).
      dtype: parameter and activation dtype name ("bfloat16", "float32" or "float16").
      bos_token_id, eos_token_ids: special tokens (eos may be several; one id or None
        is taken for eos_token_ids too). Ints, numpy's included (kept as Python ints).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self):
        for name in (
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:  # True is no count (it read as 1)
                raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
            # Python ints: a numpy one reached to_hf's config.json, which json.dumps refuses.
            object.__setattr__(self, name, int(value))
        for name in ("tie_embeddings", "qkv_bias", "o_bias", "qk_norm"):
            value = getattr(self, name)  # a str "false" is true: the other layout
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {name}={value!r}")
            object.__setattr__(self, name, bool(value))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                "num_kv_heads must divide num_heads, got "
                f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got head_dim={self.head_dim}")
        # theta > 1: RoPE's frequencies theta**(-2i/D) fall with i only then (and YaRN
        # divides by log(theta)); a zero eps is RMSNorm without one, a negative one is not.
        for name, low, ok in (
            ("rope_theta", "a number > 1", lambda x: x > 1),
            ("norm_eps", "a number >= 0", lambda x: x >= 0),
        ):
            value = getattr(self, name)
            if not (is_finite_number(value) and ok(value)):
                raise ValueError(f"{name} must be {low}, got {name}={value!r}")
            object.__setattr__(self, name, float(value))
        rs = self.rope_scaling
        if rs is not None and not isinstance(rs, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling or None, got rope_scaling={rs!r}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1):
            raise ValueError(
                f"sliding_window must be None or a positive int, got sliding_window={w!r}"
            )
        if w is not None:
            object.__setattr__(self, "sliding_window", int(w))
        # No HF family has these mixes, so to_hf could not write them: refuse them here.
        if self.o_bias and not self.qkv_bias:
            raise ValueError(
                "o_bias needs qkv_bias: HF's attention_bias biases q/k/v and o together and "
                f"no family biases o_proj alone, got qkv_bias={self.qkv_bias}, "
                f"o_bias={self.o_bias}"
            )
        if self.qk_norm and self.qkv_bias != self.o_bias:
            raise ValueError(
                "with qk_norm (Qwen3) qkv_bias and o_bias must be equal: Qwen3's "
                f"attention_bias sets both, got qkv_bias={self.qkv_bias}, o_bias={self.o_bias}"
            )
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        bos, eos = self.bos_token_id, self.eos_token_ids
        if bos is not None and not is_token_id(bos):
            raise ValueError(f"bos_token_id must be a token id (an int) or None, got {bos!r:.80}")
        # One id or None too, as HF's eos_token_id and the Tokenizer take them; int() had
        # kept 2.7 as 2, and a str "128001" as the ids (1, 2, 8, 0, 0, 1).
        ids = () if eos is None else (eos,) if is_token_id(eos) else eos
        if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Iterable):
            ids = (None,)
        ids = tuple(ids)
        if not all(map(is_token_id, ids)):
            raise ValueError(f"eos_token_ids must be token ids (ints), got {eos!r:.80}")
        bos = None if bos is None else operator.index(bos)
        object.__setattr__(self, "bos_token_id", bos)
        object.__setattr__(self, "eos_token_ids", tuple(map(operator.index, ids)))

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token occupies across all layers, in the model dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size(self.dtype)

    @classmethod
    def from_hf(cls, config: dict, *, dtype: str | None = None) -> ModelConfig:
        """Builds a config from a HuggingFace config.json dict (`pagedjax.hf_config.from_hf`:
        the families, their defaults, and the keys refused; ValueError on those)."""
        from pagedjax import hf_config  # it builds ModelConfigs: imported here, not at the top

        return hf_config.from_hf(config, dtype=dtype)

    def to_hf(self) -> dict:
        """The HuggingFace config.json dict for this config (`pagedjax.hf_config.to_hf`)."""
        from pagedjax import hf_config

        return hf_config.to_hf(self)


def _llama3_scaling(factor: float) -> RopeScaling:
    return RopeScaling(
        "llama3",
        factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


_LLAMA3_SCALING = _llama3_scaling(8.0)

PRESETS: dict[str, ModelConfig] = {
    "llama3-70b": ModelConfig(
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "llama3-8b": ModelConfig(
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "llama3.2-1b": ModelConfig(
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        hidden_size=2048,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3_scaling(32.0),
        tie_embeddings=True,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "qwen2.5-0.5b": ModelConfig(
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        hidden_size=896,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        qkv_bias=True,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    ),
    "qwen3-0.6b": ModelConfig(
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,  # H * D = 2048 != E = 1024
        hidden_size=1024,
        intermediate_size=3072,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        qk_norm=True,
        bos_token_id=151643,
        eos_token_ids=(151645,),
    ),
    "mistral-7b-v0.1": ModelConfig(
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        sliding_window=4096,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "tiny": ModelConfig(
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=512,
        rope_theta=10000.0,
        dtype="float32",
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}


def preset(name: str) -> ModelConfig:
    """Returns the named preset; raises ValueError listing the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry.

    Attributes:
      page_size: tokens per page (S); a power of two.
      num_pages: physical pages in the pool (P), shared by all sequences; P * S slots
        fewer than 2**31 (the steps address slots with int32 ids).
      dtype: K/V storage dtype name: the model's dtype, or "float8_e4m3fn" ("fp8").
    """

    page_size: int = 16
    num_pages: int = 1024
    dtype: str = "bfloat16"

    def __post_init__(self):
        s, n = self.page_size, self.num_pages
        if not is_int(s) or s <= 0 or s & (s - 1):
            raise ValueError(f"page_size must be a power of two, got page_size={s!r}")
        if not is_int(n) or n <= 0:
            raise ValueError(f"num_pages must be a positive int, got num_pages={n!r}")
        if n * s >= 2**31:  # slot ids (and the steps' out-of-range padding slot) are int32
            raise ValueError(
                f"a cache of num_pages={n} pages of page_size={s} has {n * s} slots, more "
                "than int32 slot ids address (at most 2**31 - 1)"
            )
        # Python ints (numpy's would reach summaries and JSON as numpy scalars).
        object.__setattr__(self, "page_size", int(s))
        object.__setattr__(self, "num_pages", int(n))
        object.__setattr__(self, "dtype", dtype_name(self.dtype, kv=True))

    @property
    def jnp_dtype(self):
        return _KV_DTYPES[self.dtype]

    @property
    def num_slots(self) -> int:
        return self.page_size * self.num_pages
