"""LoRA adapters in PEFT's format on the host: which adapter a request runs with
(`LoRARequest`), reading a PEFT directory (`load_adapter`) or a state dict in memory
(`adapter_from_state`) into a `LoRAAdapter`, and checking one against the model
(`check_adapter`). Putting adapters on the device and applying them is `pagedjax.lora`'s
(which re-exports this module's public names).

An adapter's update of a linear layer is `y = x @ W + scaling * (x @ A.T) @ B.T`, with
PEFT's `A` `[r, in]` and `B` `[out, r]` and `scaling = lora_alpha / r` (`lora_alpha /
sqrt(r)` with `use_rslora`); a `LoRAAdapter` holds each module's `(A.T, B.T * scaling)`
in float32.

Target modules: `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
`down_proj` of any layers; an adapter may target any subset (the rest of its slot stays
zero). Refused with a clear error: `modules_to_save` (trained copies of whole layers,
e.g. `lm_head`), embedding adapters, LoRA biases (`bias` other than "none", `lora_bias`),
DoRA, `fan_in_fan_out`, QA-LoRA (`use_qalora`), `layer_replication`, activated LoRA
(`alora_invocation_tokens`: its update starts at those tokens, not at every token),
`init_lora_weights` PiSSA, OLoRA, CorDA or LoftQ (PEFT redoes the init on loading, which
rewrites the base weights; vLLM ignores the field and serves `W + update`), an
adapter whose tensors' ranks are not its config's (`r`, `rank_pattern`: PEFT refuses it,
vLLM scales it by `lora_alpha / r`), and `adapter_model.bin` (pickled torch: convert it
to safetensors).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from pagedjax.config import ModelConfig

__all__ = [
    "TARGET_MODULES",
    "LoRAAdapter",
    "LoRARequest",
    "adapter_from_state",
    "check_adapter",
    "load_adapter",
    "module_dims",
]

# Each target module and the block that holds it in a decoder layer.
TARGET_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_UNSUPPORTED = {  # adapter_config.json keys whose non-default values we cannot serve
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "lora_bias": (False, None),  # a bias on lora_B
    "use_qalora": (False, None),  # QA-LoRA: A reads group-pooled inputs
    "layer_replication": (None, []),  # a model deeper than the base
    "alora_invocation_tokens": (None, []),  # activated LoRA: only from these tokens on
    "context_length": (0, None),  # vLLM's long-context LoRA: its own rope scaling
}
# init_lora_weights values that leave the base weights as they are (besides true, false):
# PEFT's LoraLayer.update_layer runs the init when it loads an adapter, and its others
# (PiSSA, OLoRA, CorDA, LoftQ) subtract their start from W or quantize it.
_INITS = ("gaussian", "eva", "orthogonal")
_DEFAULT_ALPHA = 8  # PEFT's LoraConfig.lora_alpha, for a config without one


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's `LoRARequest`).

    Attributes:
      lora_name: a name for it (the server's `model` field selects adapters by name).
      lora_int_id: a positive int identifying it: requests with equal ids share the
        adapter loaded once, and their prefix-cache pages (never those of another
        adapter or of the base model).
      lora_path: the PEFT directory (`adapter_config.json`, `adapter_model.safetensors`);
        a leading "~" is the user's home.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        i = self.lora_int_id
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 1:
            raise ValueError(f"lora_int_id must be a positive int, got lora_int_id={i!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise TypeError(f"lora_path must be a str or a path, got {self.lora_path!r}")
        object.__setattr__(self, "lora_int_id", int(i))
        # "~" as the user's home, as vLLM resolves an adapter path (a JSON request's path
        # has no shell to expand it)
        object.__setattr__(self, "lora_path", os.path.expanduser(os.fspath(self.lora_path)))


def module_dims(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a target module's linear layer in a model of `cfg`."""
    e, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dims = {
        "q_proj": (e, q),
        "k_proj": (e, kv),
        "v_proj": (e, kv),
        "o_proj": (q, e),
        "gate_proj": (e, i),
        "up_proj": (e, i),
        "down_proj": (i, e),
    }
    if module not in dims:
        raise ValueError(f"not a LoRA target module: {module!r} (one of {sorted(dims)})")
    return dims[module]


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A loaded adapter, on the host.

    Attributes:
      weights: (layer, module) -> (a [in, r], b [r, out]) float32, the scaling folded
        into b: the update of that layer's module is `x @ a @ b`.
      rank: the largest r of its modules.
      path: the directory it was read from (None: built in memory).
    """

    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    rank: int
    path: str | None = None

    @property
    def num_bytes(self) -> int:
        """Host bytes of its weights."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _config(root: Path) -> dict:
    file = root / "adapter_config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no adapter_config.json in LoRA adapter directory {root}")
    try:
        conf = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    return _check_config(conf, str(file))


def _check_config(conf, file: str) -> dict:
    """An adapter_config.json's dict, checked for what we can serve (`file`: where it
    came from, for the messages)."""
    if not isinstance(conf, Mapping):
        raise ValueError(f"{file} must hold a JSON object, got {type(conf).__name__}")
    conf = dict(conf)
    kind = conf.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{file}: peft_type={kind!r}: only LoRA adapters are supported")
    for key, allowed in _UNSUPPORTED.items():
        if conf.get(key, allowed[0]) not in allowed:
            raise ValueError(
                f"{file}: {key}={conf[key]!r} is not supported (LoRA adapters without it only)"
            )
    init = conf.get("init_lora_weights", True)
    if not (init in (True, False, None) or str(init).lower() in _INITS):
        raise ValueError(
            f"{file}: init_lora_weights={init!r} is not supported: PEFT redoes the init when "
            "it loads the adapter, and PiSSA, OLoRA, CorDA and LoftQ rewrite the base weights "
            "then, so the trained model is not these weights plus the update (convert it into "
            "a plain LoRA: save_pretrained(..., path_initial_model_for_weight_conversion=...))"
        )
    rslora = conf.get("use_rslora")
    if rslora is not None and not isinstance(rslora, bool):
        raise ValueError(f"{file}: use_rslora must be true or false, got {rslora!r}")
    values = [("lora_alpha", conf.get("lora_alpha", _DEFAULT_ALPHA), (int, float))]
    if "r" in conf:
        values.append(("r", conf["r"], int))
    for field, kind in (("alpha_pattern", (int, float)), ("rank_pattern", int)):
        patterns = conf.get(field) or {}
        if not isinstance(patterns, Mapping):
            raise ValueError(f"{file}: {field} must be an object, got {patterns!r:.80}")
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"{file}: {field} key {pattern!r} is not a regex ({e})") from None
            values.append((f"{field}[{pattern!r}]", value, kind))
    for name, value, kind in values:
        if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
            what = "int" if kind is int else "number"
            raise ValueError(f"{file}: {name} must be a positive {what}, got {value!r}")
    return conf


def _pattern(conf: dict, field: str, layer: int, module: str):
    """(key, value) of `conf[field]`'s (`alpha_pattern`, `rank_pattern`) first key that
    the module's name ends with (PEFT's rule: a regex matched against the end of the
    dotted name), or None."""
    name = f"model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
    for pattern, value in (conf.get(field) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return pattern, value
    return None


def _alpha(conf: dict, layer: int, module: str) -> float:
    """lora_alpha of one module: `alpha_pattern`'s (`_pattern`), else `lora_alpha`."""
    hit = _pattern(conf, "alpha_pattern", layer, module)
    return float(conf.get("lora_alpha", _DEFAULT_ALPHA) if hit is None else hit[1])


def _check_ranks(conf: dict, pairs, shapes, where: str, source: str) -> None:
    """Each module's rank (its tensors') against the one the config gives it:
    `rank_pattern`'s (`_pattern`), else `r` (when given). PEFT builds the module with
    that rank and refuses other tensors; vLLM would scale them by `lora_alpha / r`: an
    adapter whose tensors and config disagree has no one meaning, so it is refused.
    `source` names the config in the message."""
    for (layer, module), ab in sorted(pairs.items()):
        r = shapes[ab["A"]][0]
        hit = _pattern(conf, "rank_pattern", layer, module)
        name, want = ("r", conf.get("r")) if hit is None else (f"rank_pattern[{hit[0]!r}]", hit[1])
        if want is not None and want != r:
            raise ValueError(
                f"{where}: layer {layer} {module}: rank {r}, but {source}'s {name} is {want}"
            )


def load_adapter(path, cfg: ModelConfig, *, max_rank: int | None = None) -> LoRAAdapter:
    """Reads a PEFT LoRA adapter directory for a model of `cfg`.

    Every tensor is checked before any is read: names (`...layers.{i}.self_attn.q_proj
    .lora_A.weight` and the like, with or without PEFT's `base_model.model.` prefix),
    layer indices, shapes (`A` `[r, in]`, `B` `[out, r]` as the model's dimensions
    give them, `r` the config's `rank_pattern` or `r`) and that each A has its B.

    Args:
      path: the adapter directory.
      cfg: the base model's config.
      max_rank: refuse adapters with a module of larger rank (the engine's
        `max_lora_rank`).

    Raises:
      FileNotFoundError: no such directory, or no adapter_config.json /
        adapter_model.safetensors in it.
      ValueError: naming the tensor, key or value the engine cannot serve.
    """
    from pagedjax.safetensors_file import DTYPES, read_header, read_tensor

    root = Path(path)
    if root.is_file():
        raise FileNotFoundError(
            f"LoRA adapter path {str(path)!r} is a file: give the PEFT adapter's directory "
            "(adapter_config.json, adapter_model.safetensors)"
        )
    if not root.is_dir():
        raise FileNotFoundError(f"LoRA adapter directory {str(path)!r} does not exist")
    conf = _config(root)
    file = root / "adapter_model.safetensors"
    if not file.is_file():
        extra = (
            " (adapter_model.bin is pickled torch: save it as safetensors)"
            * (root / "adapter_model.bin").is_file()
        )
        raise FileNotFoundError(f"no adapter_model.safetensors in {root}{extra}")
    infos = read_header(file)
    shapes = {name: info.shape for name, info in infos.items()}
    pairs, rank = _layout(shapes, cfg, str(file), max_rank, str(root))
    _check_ranks(conf, pairs, shapes, str(file), "adapter_config.json")
    for name, info in infos.items():
        if info.dtype not in DTYPES:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {info.dtype}: LoRA weights must be "
                f"floating point ({', '.join(DTYPES)})"
            )
    with open(file, "rb") as f:
        weights = _fold(conf, pairs, lambda name: read_tensor(f, infos[name]), str(file))
    return LoRAAdapter(weights, rank, str(root))


def adapter_from_state(
    state: Mapping, config: Mapping, cfg: ModelConfig, *, max_rank: int | None = None
) -> LoRAAdapter:
    """An adapter from PEFT's state dict in memory, e.g. one trained in JAX: {name: array}
    with the names `load_adapter` reads (`...layers.{i}.self_attn.q_proj.lora_A.weight`,
    `A` `[r, in]`, `B` `[out, r]`; numpy or jax arrays) and `config`, the dict of an
    adapter_config.json (`r`, `lora_alpha`, optionally `use_rslora`, `alpha_pattern`,
    `rank_pattern`; without `r`, each module's rank is its tensors').
    Checked as `load_adapter` checks a directory (ValueError naming what is wrong).
    Serve it with `LLM.add_lora(request, adapter=...)`."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of arrays, got {type(state).__name__}")
    conf = _check_config(config, "the adapter config")
    where = "the adapter state"
    shapes = {name: tuple(np.shape(x)) for name, x in state.items()}
    pairs, rank = _layout(shapes, cfg, where, max_rank, "the adapter")
    _check_ranks(conf, pairs, shapes, where, "the adapter config")
    for name, x in state.items():
        if not _is_float(dtype := _dtype(x)):
            raise ValueError(
                f"{where}: tensor {name!r} has dtype {dtype}: LoRA weights must be floating point"
            )
    return LoRAAdapter(_fold(conf, pairs, lambda name: np.asarray(state[name]), where), rank)


def _dtype(x) -> np.dtype:
    try:
        return np.dtype(x.dtype)
    except (AttributeError, TypeError):  # a list, a torch tensor
        return np.asarray(x).dtype


def _is_float(dtype: np.dtype) -> bool:
    """Real floating point (bfloat16 included): what LoRA weights may be."""
    return jnp.issubdtype(dtype, jnp.floating)


def _layout(shapes: Mapping[str, tuple], cfg, where: str, max_rank, what: str):
    """Checks an adapter's tensor names and shapes against the model; returns
    ({(layer, module): {"A": name, "B": name}}, rank)."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name in shapes:
        m = _KEY.fullmatch(name) if isinstance(name, str) else None
        if m is None or TARGET_MODULES.get(m[3]) != m[2]:
            raise ValueError(
                f"{where}: tensor {name!r} is not a LoRA A/B weight of a supported module "
                f"({', '.join(TARGET_MODULES)}); embedding, lm_head and bias adapters "
                "are not supported"
            )
        layer = int(m[1])
        if layer >= cfg.num_layers:
            raise ValueError(f"{where}: {name}: layer {layer} >= the model's {cfg.num_layers}")
        ab = pairs.setdefault((layer, m[3]), {})
        if m[4] in ab:  # with and without PEFT's prefix: which one is meant?
            raise ValueError(
                f"{where}: {name!r} and {ab[m[4]]!r} are both layer {layer} {m[3]}'s lora_{m[4]}"
            )
        ab[m[4]] = name
    if not pairs:
        raise ValueError(f"{where} holds no LoRA weights")
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        at = f"{where}: layer {layer} {module}"
        if missing := {"A", "B"} - set(ab):
            raise ValueError(f"{at}: lora_{missing.pop()} is missing")
        n_in, n_out = module_dims(cfg, module)
        ra, rb = shapes[ab["A"]], shapes[ab["B"]]
        if len(ra) != 2 or len(rb) != 2 or ra[1] != n_in or rb[0] != n_out or ra[0] != rb[1]:
            raise ValueError(
                f"{at}: lora_A {list(ra)} and lora_B {list(rb)} do not fit the model's "
                f"{module} ({n_in} in, {n_out} out): expected [r, {n_in}] and [{n_out}, r]"
            )
        if ra[0] < 1:
            raise ValueError(f"{at}: rank 0")
        rank = max(rank, ra[0])
    if max_rank is not None and rank > max_rank:
        raise ValueError(
            f"LoRA adapter {what} has rank {rank} > max_lora_rank={max_rank} (raise max_lora_rank)"
        )
    return pairs, rank


def _fold(
    conf: dict, pairs, read, where: str
) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """Each module's (a [in, r], b [r, out] * scaling) in float32; `read(name)` gives a
    tensor."""
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        a = np.asarray(read(ab["A"]), np.float32)  # [r, in]
        b = np.asarray(read(ab["B"]), np.float32)  # [out, r]
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"{where}: LoRA weights of layer {layer} {module} are not all finite")
        r = a.shape[0]
        alpha = _alpha(conf, layer, module)
        scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
        weights[layer, module] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T * scaling))
    return weights


def check_adapter(
    adapter: LoRAAdapter, cfg: ModelConfig, *, max_rank: int | None = None, what: str = ""
) -> None:
    """Checks that an adapter (one built in memory, perhaps for another model) fits a
    model of `cfg`, as `load_adapter` checks a directory: each (layer, module) exists in
    the model, its (a, b) are floating point, `[in, r]` and `[r, out]` with the module's
    dimensions, and `adapter.rank` is the largest r (at most `max_rank`). `what` names it
    in the messages.

    Raises:
      TypeError: not a LoRAAdapter.
      ValueError: naming the first weights that do not fit.
    """
    if not isinstance(adapter, LoRAAdapter):
        raise TypeError(f"adapter must be a pagedjax.lora.LoRAAdapter, got {adapter!r:.80}")
    name = f"LoRA adapter {what}".rstrip()
    if not adapter.weights:
        raise ValueError(f"{name} holds no weights")
    rank = 0
    for key, ab in adapter.weights.items():
        layer, module = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise ValueError(f"{name}: weights key {key!r} is not (layer, module)")
        if not isinstance(ab, tuple) or len(ab) != 2:
            raise ValueError(f"{name}: weights[{key!r}] must be a tuple (a, b)")
        a, b = ab
        if module not in TARGET_MODULES:
            raise ValueError(f"{name}: {module!r} is not a LoRA target module")
        at = f"{name}: layer {layer} {module}"
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"{at}: layer {layer} is not in the model's {cfg.num_layers} layers")
        n_in, n_out = module_dims(cfg, module)
        sa, sb = np.shape(a), np.shape(b)
        if len(sa) != 2 or len(sb) != 2 or (sa[0], sb[1]) != (n_in, n_out) or sa[1] != sb[0]:
            raise ValueError(
                f"{at}: a {list(sa)} and b {list(sb)} do not fit the model's {module} "
                f"({n_in} in, {n_out} out): expected [{n_in}, r] and [r, {n_out}]"
            )
        if sa[1] < 1:
            raise ValueError(f"{at}: rank 0")
        for part, x in (("a", a), ("b", b)):
            if not _is_float(dtype := _dtype(x)):  # (complex ones would lose their imaginary part)
                raise ValueError(
                    f"{at}: {part} has dtype {dtype}: LoRA weights must be floating point"
                )
        rank = max(rank, sa[1])
    if adapter.rank != rank:
        raise ValueError(f"{name} has rank={adapter.rank}, but its modules' largest rank is {rank}")
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"{name} has rank {rank} > max_lora_rank={max_rank} (raise max_lora_rank)")
