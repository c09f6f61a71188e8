"""HuggingFace `config.json` <-> `ModelConfig`: what each supported family's keys mean.

`from_hf` reads the Llama family as HF's config classes and attention modules do
(Llama 2/3/3.1/3.2, Qwen2, Qwen3 (dense), Mistral): which biases exist, how the
sliding window is switched on, what an absent key defaults to, and which keys the
model does not implement (refused by name rather than served wrong). `to_hf` writes
the inverse. `ModelConfig.from_hf` / `ModelConfig.to_hf` call these.
"""

from __future__ import annotations

import dataclasses

from pagedjax.config import ROPE_SCALING_PARAMS, ModelConfig, RopeScaling, is_finite_number

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
_MODEL_TYPES = (None, "llama", "qwen2", "qwen3", "mistral")
_ARCH_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
# What HF's config class of each family reads a key as when config.json leaves it out
# (None: neither architectures nor model_type, read as Llama). A null
# num_key_value_heads is MHA in every family; only an absent one takes these. The
# Qwen windows apply only with `use_sliding_window: true`.
_HF_ABSENT = {
    "llama": dict(
        max_position_embeddings=2048, intermediate_size=11008, num_key_value_heads=None,
        head_dim=None, sliding_window=None,
    ),
    "mistral": dict(
        max_position_embeddings=131072, intermediate_size=14336, num_key_value_heads=8,
        head_dim=None, sliding_window=4096,
    ),
    "qwen2": dict(
        max_position_embeddings=32768, intermediate_size=22016, num_key_value_heads=32,
        head_dim=None, sliding_window=4096,
    ),
    "qwen3": dict(
        max_position_embeddings=32768, intermediate_size=22016, num_key_value_heads=32,
        head_dim=128, sliding_window=4096,
    ),
}  # fmt: skip
_HF_ABSENT[None] = _HF_ABSENT["llama"]


def from_hf(config: dict, *, dtype: str | None = None) -> ModelConfig:
    """Builds a config from a HuggingFace config.json dict.

    Accepts the classic `rope_theta` / `rope_scaling` keys and the newer
    `rope_parameters` form, as transformers 5 reads them: a set `rope_scaling` replaces
    `rope_parameters` whole, and a `rope_theta` inside the dict wins over the top-level
    key (`_hf_rope_dict`). Scaling "linear", "llama3" or "yarn" is read as current
    transformers reads it (`_rope_scaling`; with yarn, `max_position_embeddings`
    becomes at least `original_max_position_embeddings * factor`, the context YaRN
    extends to, as vLLM serves it), a missing `head_dim` (hidden_size // heads; 128 for
    Qwen3, as HF's Qwen3Config; a null one is hidden_size // heads in all), and
    `eos_token_id` as an int or a list. The family is named by `architectures` (its
    first entry), else by `model_type`; a `model_type` must be a supported one either way
    (HF builds the model_type's class whatever `architectures` says).
    Qwen3 means `qk_norm`. Biases follow HF's attention modules: `attention_bias`
    biases q/k/v and o_proj in Llama and Qwen3 (`qkv_bias` and `o_bias`); Qwen2
    always biases q/k/v and never o_proj; Mistral has no biases (HF ignores
    `attention_bias` in both, and so does this). The sliding window is read as HF
    does (see `_hf_sliding_window`); only a window on every layer or on none is
    supported. Absent optional keys take the defaults of the family's HF config class
    (`_HF_ABSENT`: `max_position_embeddings` 2048 for Llama, 131072 for Mistral,
    32768 for Qwen; `intermediate_size`, `num_key_value_heads`, the window; and
    `rms_norm_eps` 1e-6, `rope_theta` 10000 in all); absent `bos_token_id` and
    `eos_token_id` are None (HF's Llama and Mistral say 1 and 2; the tokenizer's
    and generation_config's count instead). The model runs in the `dtype` argument,
    else in float32 if the config's `dtype` key (4.x's `torch_dtype`; `dtype` wins where
    both are) says float32, and in bfloat16 for any other (float16 too; `_hf_dtype`).

    Raises:
      ValueError: an unsupported architecture anywhere in `architectures` (a list), an
        unsupported `model_type` or one of another family than `architectures`,
        unsupported or incomplete rope scaling, missing keys, a number of the wrong type
        (named), a different sliding window per layer (or a Mistral `layer_types` that
        contradicts HF's window on every layer), or a key the model does not implement
        (`hidden_act` other than silu, a Llama's `mlp_bias`,
        `partial_rotary_factor` < 1 at the top level or in the RoPE dict, RoPE parameters
        per layer type, `quantization_config`).
    """
    archs = config.get("architectures") or []
    if not isinstance(archs, (list, tuple)):  # a bare string was read as a list of its letters
        raise ValueError(f"config.json: architectures must be a list, got architectures={archs!r}")
    unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if unsupported:  # a second, unsupported class may be what the weights really are
        raise ValueError(
            f"unsupported architecture {unsupported} (architectures={archs}); "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = config.get("model_type")
    if model_type not in _MODEL_TYPES:
        # HF's AutoModel builds the class of the model_type's config whatever architectures
        # says (a "granite" labelled LlamaForCausalLM scales its logits and residuals).
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures={archs}); "
            f"supported: {list(_MODEL_TYPES[1:])}"
        )
    other = [a for a in archs if model_type is not None and _ARCH_FAMILIES[a] != model_type]
    if other:  # (a Mistral class with "llama": HF builds a Llama, with no window)
        raise ValueError(
            f"config.json: architectures {other} are not model_type {model_type!r}'s: "
            "transformers builds the model_type's model, so the two disagree on what the "
            "weights are; make them one family"
        )
    missing = [
        k
        for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
        if k not in config
    ]
    if missing:
        nested = " (a multimodal wrapper's text_config?)" if "text_config" in config else ""
        raise ValueError(f"config.json is missing required keys: {missing}{nested}")
    family = _ARCH_FAMILIES[archs[0]] if archs else model_type
    _refuse_unimplemented(config, family)
    absent = _HF_ABSENT[family]
    num_heads = _hf_number(config, "num_attention_heads", int)
    hidden = _hf_number(config, "hidden_size", int)
    # An absent head_dim is 128 in HF's Qwen3Config, else hidden_size // heads; a null one
    # is hidden_size // heads in every family (HF 5's Qwen3Config refuses it; vLLM derives).
    head_dim = None
    if config.get("head_dim", 0) is not None:
        head_dim = _hf_number(config, "head_dim", int, absent["head_dim"])
    if head_dim is None and num_heads > 0:  # else ModelConfig names the bad num_heads
        head_dim = hidden // num_heads
    if config.get("num_key_value_heads", 0) is None:  # null: MHA in every family
        kv_heads = num_heads
    else:
        kv = absent["num_key_value_heads"] or num_heads
        kv_heads = _hf_number(config, "num_key_value_heads", int, kv)
    max_pos = _hf_number(config, "max_position_embeddings", int, absent["max_position_embeddings"])
    rope = _hf_rope_dict(config)
    if "rope_theta" in rope:  # HF: the dict's theta wins over the top-level key
        theta = _hf_number(rope, "rope_theta", float)
    else:
        theta = _hf_number(config, "rope_theta", float, 1e4)
    scaling = rope if _rope_type(rope) != "default" else None
    top_original = config.get("original_max_position_embeddings")  # Phi-3's place for it
    rope_scaling = _rope_scaling(scaling, max_pos, top_original)
    if rope_scaling is not None and rope_scaling.rope_type == "yarn":
        # Qwen's cards add yarn to a config whose max_position_embeddings is the original
        # context; the model then serves factor times that (vLLM's rule; HF has no limit).
        yarn_len = rope_scaling.original_max_position_embeddings * rope_scaling.factor
        max_pos = max(max_pos, int(yarn_len))
    eos = config.get("eos_token_id")
    eos = () if eos is None else (eos if isinstance(eos, (list, tuple)) else (eos,))
    if any(isinstance(t, bool) or not isinstance(t, int) for t in eos):
        raise ValueError(f"config.json: eos_token_id must be ints, got {config['eos_token_id']}")
    # transformers 5 reads `dtype` first where a config has both (4.x wrote torch_dtype).
    torch_dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    attention_bias = bool(config.get("attention_bias", False))
    if family in ("qwen2", "mistral"):  # their HF attention hard-codes its biases
        attention_bias = False
    return ModelConfig(
        num_layers=_hf_number(config, "num_hidden_layers", int),
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=_hf_number(config, "intermediate_size", int, absent["intermediate_size"]),
        vocab_size=_hf_number(config, "vocab_size", int),
        max_position_embeddings=max_pos,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        norm_eps=_hf_number(config, "rms_norm_eps", float, 1e-6),  # HF's, every family
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or family == "qwen2",
        o_bias=attention_bias,
        qk_norm=family == "qwen3",
        sliding_window=_hf_sliding_window(config, family, max_pos),
        dtype=_hf_dtype(torch_dtype) if dtype is None else dtype,
        bos_token_id=_hf_number(config, "bos_token_id", int, nullable=True),
        eos_token_ids=tuple(eos),
    )


def to_hf(cfg: ModelConfig) -> dict:
    """The HuggingFace config.json dict for this config (inverse of from_hf).

    The architecture is Qwen3 with `qk_norm`, else Qwen2 with q/k/v biases alone,
    else Mistral with a sliding window and no biases, else Llama (with
    `attention_bias`, and a window as `layer_types`, if set). `attention_bias` is
    written for Llama and Qwen3 only, the families whose HF attention reads it. A Qwen window is
    written both ways HF has read it: `max_window_layers: 0` and an explicit
    `layer_types` list. `rope_scaling` is the kind and its parameters (HF's names);
    from_hf reads it back equal, though with yarn a `max_position_embeddings` below
    `original_max_position_embeddings * factor` reads back raised to that. Unset
    `bos_token_id` / `eos_token_id` are written as null, not left out (HF's Llama and
    Mistral read an absent one as 1 / 2).
    """
    if cfg.qk_norm:
        arch, model_type = "Qwen3ForCausalLM", "qwen3"
    elif cfg.qkv_bias and not cfg.o_bias:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    elif cfg.sliding_window is not None and not cfg.qkv_bias:
        arch, model_type = "MistralForCausalLM", "mistral"
    else:
        arch, model_type = "LlamaForCausalLM", "llama"
    out = {
        "architectures": [arch],
        "model_type": model_type,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": cfg.dtype,
        "hidden_act": "silu",
    }
    if model_type in ("llama", "qwen3"):
        out["attention_bias"] = cfg.o_bias  # equal to qkv_bias in both
    if model_type in ("qwen2", "qwen3"):
        out["use_sliding_window"] = cfg.sliding_window is not None
        out["sliding_window"] = cfg.sliding_window
        if cfg.sliding_window is not None:
            out["max_window_layers"] = 0
            out["layer_types"] = ["sliding_attention"] * cfg.num_layers
    elif cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
        if model_type == "llama":  # HF's Llama reads no window; vLLM's reads layer_types
            out["layer_types"] = ["sliding_attention"] * cfg.num_layers
    if cfg.rope_scaling is not None:  # its kind and the parameters that kind takes
        rs = dataclasses.asdict(cfg.rope_scaling)
        out["rope_scaling"] = {k: v for k, v in rs.items() if v is not None}
    # Written when unset too: an absent key is 1 and 2 to HF's Llama and Mistral, and
    # transformers' generate would stop at token 2.
    out["bos_token_id"] = cfg.bos_token_id
    eos = cfg.eos_token_ids
    out["eos_token_id"] = (eos[0] if len(eos) == 1 else list(eos)) if eos else None
    return out


def _hf_number(config: dict, key: str, kind: type, default=None, *, nullable: bool = False):
    """`config[key]` as `kind` (int or float), `default` when the key is absent (or null,
    where HF reads null as its default: `nullable`). Anything else, null included, is a
    ValueError naming the key: a broken config must not run on a guessed default. So is
    Infinity or NaN (Python's json reads both; int() of them named no key)."""
    v = config.get(key)
    if key not in config or (v is None and nullable):
        return default
    ok = isinstance(v, (int, float)) and is_finite_number(v)
    if not ok or (kind is int and v != int(v)):
        what = "an int" if kind is int else "a number"
        raise ValueError(f"config.json: {key} must be {what}, got {key}={v!r}")
    return kind(v)


def _hf_sliding_window(config: dict, family: str | None, max_pos: int) -> int | None:
    """The one sliding window of every layer, or None; mixed layers are a ValueError.

    HF's rules: Mistral slides every layer when `sliding_window` is set (HF's Mistral
    ignores `use_sliding_window` and `layer_types`; a `layer_types` marking any layer
    "full_attention" is refused: it describes another model than the one HF serves).
    HF's Llama ignores `sliding_window` (its attention passes none: "the main diff" of
    Mistral's), so a Llama config slides only the layers its `layer_types` marks, as
    vLLM's Llama reads it; without that list, a stray `sliding_window` key is ignored.
    Qwen2/Qwen3 slide only with `use_sliding_window: true` (default false), and then
    the layers that `layer_types` marks "sliding_attention", or, without that list,
    layers `i >= max_window_layers` (default 28; older transformers read it the other
    way round, which only matters for mixed cases, refused here). A window of at least
    `max_position_embeddings` (`max_pos`) never masks anything and is dropped. An absent
    `sliding_window` is HF's default: 4096 for Mistral and Qwen, none for Llama. A window
    that is read, and `max_window_layers`, must be ints (HF's config classes refuse
    others too; 4.5 was truncated to 4 and `true` read as a window of 1).
    """
    qwen = family in ("qwen2", "qwen3")
    layer_types = config.get("layer_types")
    # HF's Mistral reads no use_sliding_window (its config class has none).
    if family != "mistral" and not config.get("use_sliding_window", not qwen):
        return None
    if layer_types is None and family in ("llama", None):  # None: no family named
        return None
    window = _HF_ABSENT[family]["sliding_window"]  # when absent; null is no window
    if "sliding_window" in config:
        window = _hf_number(config, "sliding_window", int, nullable=True)
    if window is None:
        return None
    num_layers = int(config["num_hidden_layers"])
    if layer_types is not None and family == "mistral":
        # HF's Mistral slides every layer whatever layer_types says (it warns and points at
        # Ministral); a list that says otherwise is a model HF would not serve as written.
        if list(layer_types) != ["sliding_attention"] * num_layers:
            raise ValueError(
                f"MistralForCausalLM slides every layer by sliding_window={window} (HF ignores "
                f"layer_types), but layer_types={layer_types} says otherwise; set "
                "sliding_window to null for no window, or drop layer_types"
            )
        sliding = [True] * num_layers
        how = ""
    elif layer_types is not None:
        sliding = [t == "sliding_attention" for t in layer_types]
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown or len(layer_types) != num_layers:
            raise ValueError(
                f"layer_types must list 'full_attention' or 'sliding_attention' for each of "
                f"the {num_layers} layers, got layer_types={layer_types}"
            )
        how = f"layer_types={layer_types}"
    elif qwen:
        first = _hf_number(config, "max_window_layers", int, 28)
        sliding = [i >= first for i in range(num_layers)]
        how = f"max_window_layers={first} with num_hidden_layers={num_layers}"
    else:
        sliding = [True] * num_layers
        how = ""
    if not any(sliding):
        return None
    if not all(sliding):
        raise ValueError(
            f"sliding_window={window} on only some layers ({how}: {sum(sliding)} of "
            f"{num_layers} slide) is not supported; only a window on every layer or none"
        )
    if window < 1:
        raise ValueError(f"sliding_window must be a positive int, got sliding_window={window}")
    return None if window >= max_pos else window


def _refuse_unimplemented(config: dict, family: str | None) -> None:
    """Raises ValueError naming a config.json key that changes the model's math in a way
    the model does not implement (reading past it would serve garbage without an error).
    `mlp_bias` counts for Llama only: Qwen2's, Qwen3's and Mistral's HF MLPs hard-code
    bias=False and never read it (a checkpoint with MLP biases still fails to load)."""
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # HF's ACT2FN: "swish" is SiLU too
        raise ValueError(f"unsupported hidden_act={act!r}; the MLP is SwiGLU (hidden_act 'silu')")
    if config.get("mlp_bias") and family in ("llama", None):
        raise ValueError(
            f"unsupported mlp_bias={config['mlp_bias']!r}: MLP projection biases are not "
            "implemented"
        )
    rope = _hf_rope_dict(config)
    for prf in (config.get("partial_rotary_factor"), rope.get("partial_rotary_factor")):
        if prf is not None and prf != 1:
            raise ValueError(
                f"unsupported partial_rotary_factor={prf!r}: RoPE rotates the whole head"
            )
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(
            f"quantized checkpoints are not supported (quantization_config with "
            f"quant_method={method!r}); use the unquantized (bf16/fp16/fp32) checkpoint"
        )


def _hf_rope_dict(config: dict) -> dict:
    """The one RoPE dict HF 5 reads (`convert_rope_params_to_dict`): `rope_scaling` if set,
    replacing `rope_parameters` whole (its rope_theta too), else `rope_parameters`. A dict
    of dicts (HF 5's parameters per layer type, for hybrid models) is a ValueError."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    if not isinstance(rope, dict):
        raise ValueError(f"config.json: {key} must be an object, got {key}={rope!r}")
    per_layer = sorted(k for k, v in rope.items() if isinstance(v, dict))
    if per_layer:  # HF 5's form for hybrid models; read flat, it was silently no scaling
        raise ValueError(
            f"config.json: {key} gives RoPE parameters per layer type ({per_layer}); "
            "not supported: every layer of these families shares one RoPE"
        )
    return rope


def _rope_type(scaling: dict) -> str:
    """HF's "rope_type", or the older "type" key; "default" when neither is there."""
    return scaling.get("rope_type", scaling.get("type", "default"))


def _hf_dtype(torch_dtype: str) -> str:
    """The dtype a checkpoint runs in by default: float32 stays, anything else (float16
    too) is bfloat16, the dtype the kernels are tuned and GPU-tested in (float16 runs,
    in the interpreter too, but untimed; `dtype="float16"` asks for it)."""
    name = str(torch_dtype).removeprefix("torch.")
    return "float32" if name == "float32" else "bfloat16"


def _rope_scaling(scaling: dict | None, max_pos: int, top_original=None) -> RopeScaling | None:
    """HF's `rope_scaling` (or `rope_parameters`) dict as a RopeScaling; None for none.

    Read as current transformers (5.x; 4.x since its PR #40320, Aug 2025) reads it.
    yarn: `factor` is used as given (4.x releases before that PR replaced it by
    max_position_embeddings / original_max_position_embeddings whenever the latter was
    set, which left Qwen's recommended config, whose two lengths are equal, unscaled;
    HF now only warns when they differ); a null `factor` is that ratio (5.x); a null
    `truncate` is False (HF reads it falsy; absent is True). llama3 and yarn: an absent
    `original_max_position_embeddings` is `max_pos` (5.x's `standardize_rope_params`;
    4.x raised), and a top-level `original_max_position_embeddings` in config.json
    (`top_original`; None: absent or null) replaces the dict's, as transformers 5 reads
    it (`standardize_rope_params` gives it priority; 4.x ignored it). Absent beta_fast /
    beta_slow / truncate are HF's 32 / 1 / True (`RopeScaling`).

    Raises:
      ValueError: an unsupported kind ("dynamic", "longrope", ...), a missing required
        key (HF raises too), or a bad value (`RopeScaling` names it). Keys the kind
        does not read (yarn's `finetuned`, linear's `original_max_position_embeddings`)
        are ignored, as HF ignores them: they do not change HF's model either.
    """
    if not scaling:
        return None
    kind = _rope_type(scaling)
    if kind == "default":
        return None
    if not isinstance(kind, str) or kind not in ROPE_SCALING_PARAMS:  # a list is unhashable
        raise ValueError(
            f"unsupported rope scaling type {kind!r}; supported: "
            f"{sorted(ROPE_SCALING_PARAMS)} (or none)"
        )
    required, optional = ROPE_SCALING_PARAMS[kind]
    values = {k: scaling[k] for k in required + optional if k in scaling}
    if top_original is not None and kind in ("llama3", "yarn"):
        values["original_max_position_embeddings"] = top_original
    if kind in ("llama3", "yarn"):  # HF 5's standardize_rope_params: absent is max_pos
        original = values.setdefault("original_max_position_embeddings", max_pos)
    if kind == "yarn":
        if "factor" in values and values["factor"] is None:  # HF 5: the lengths' ratio
            ok = is_finite_number(original) and original > 0
            values["factor"] = max_pos / original if ok else 1.0  # bad: RopeScaling names it
        if "truncate" in values and values["truncate"] is None:  # HF: get("truncate", True)
            values["truncate"] = False  # is None, falsy: the range is not rounded
    missing = [k for k in required if values.get(k) is None]
    if missing:  # HF refuses these too; a guessed factor would be a different model
        raise ValueError(f"rope scaling {kind!r} needs {missing}, got rope_scaling={scaling}")
    return RopeScaling(kind, **values)
