"""Checkpoints: HuggingFace safetensors directories in and out; either kind loaded.

HF directories (`config.json` plus `model.safetensors`, or shards listed by
`model.safetensors.index.json`) map onto our parameter paths through `_RULES`, a
declarative table of (HF name template, our path template, transpose); the first
matching row wins. Loading runs in two passes: the first reads only the safetensors
headers and checks every name, shape and dtype against `param_shapes(cfg)`,
collecting all problems into one `CheckpointError`; the second reads tensors shard
by shard, one tensor at a time, casting and moving each to the device before the next
is read, so host memory peaks near one copy of the model (measured on the CPU, where
the device is host memory: 1.03x a 1.9 GB bf16 checkpoint above the process's RSS
before the load, where reading through safetensors took 1.8-2.3x; see `_load_shard`).

Decisions:

* Tied embeddings: with `tie_word_embeddings` the checkpoint normally has no
  `lm_head.weight`. If it has one, it is accepted only when it equals
  `model.embed_tokens.weight` exactly (some exporters write the shared matrix twice);
  a different matrix is an error, since silently dropping a trained head would change
  the model. The two are compared between the passes, before the long second one.
* Reading (`pagedjax.safetensors_file`): each tensor is read from the byte range its
  header gives (checked in pass 1) into a fresh buffer, as `ml_dtypes.bfloat16` for
  bf16; no file is memory mapped, so a shard's pages do not pile up in the process's
  RSS while it loads.
* float16: a value outside float16's range (|x| >= 65520, possible in bf16 and fp32
  checkpoints) would become inf when the model runs in float16; such tensors are
  named in a `CheckpointError` instead (HF's `.to(torch.float16)` makes them inf).
* Broken files are named from their headers before any tensor is read: a shard cut
  short (an interrupted download), a git-lfs pointer in place of the weights, byte
  ranges that disagree with a tensor's shape, overlap or leave gaps (a tensor would
  read another's bytes), a broken symlink; malformed JSON names its file.
* Known harmless extras (`rotary_emb.inv_freq` buffers) are ignored; any other
  unknown name is an error. Where some are a quantized format's (GPTQ/AWQ `qweight`,
  `scales`, FP8 `weight_scale`, bitsandbytes `absmax`, ...), the error's first line
  says the checkpoint is quantized, which is what a user must change (a config.json
  with `quantization_config` is refused earlier, by `ModelConfig.from_hf`).

Orbax checkpoints (`save_params`, `restore_params`) live in `pagedjax.orbax_checkpoint`
and are re-exported here; `load_checkpoint` takes either kind of directory.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from pagedjax.config import ModelConfig
from pagedjax.jsonfile import read_json_object
from pagedjax.model import Params, param_shapes, params_from_flat, params_to_flat
from pagedjax.orbax_checkpoint import (  # re-exported
    ORBAX_META_FILE,
    ORBAX_PARAMS_DIR,
    config_from_json,
    config_to_json,
    read_orbax_config,
    restore_params,
    save_params,
)
from pagedjax.safetensors_file import DTYPES as _ST_DTYPES
from pagedjax.safetensors_file import TensorInfo as _TensorInfo
from pagedjax.safetensors_file import read_header as _read_header
from pagedjax.safetensors_file import read_tensor as _read_tensor

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "ORBAX_META_FILE",
    "ORBAX_PARAMS_DIR",
    "SAFETENSORS_FILE",
    "CheckpointError",
    "checkpoint_format",
    "config_from_json",
    "config_to_json",
    "hf_to_path",
    "load_checkpoint",
    "load_hf_checkpoint",
    "path_to_hf",
    "read_checkpoint_config",
    "read_orbax_config",
    "restore_params",
    "save_hf_checkpoint",
    "save_params",
]

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_F16 = np.dtype(np.float16)
_MAX_LISTED = 40  # per problem kind, so a wrong-model error stays readable


@dataclass(frozen=True)
class _Rule:
    """One row of the name table; `{name}` placeholders match one dotted component."""

    hf: str
    ours: str
    transpose: bool = False  # HF Linear `weight` is [out, in]; our `kernel` is [in, out]


_RULES = (
    _Rule("model.embed_tokens.weight", "embed_tokens.embedding"),
    _Rule("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm.scale"),
    # Before the projections' rule, which would take these for `kernel`s (Qwen3 qk_norm).
    _Rule("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.self_attn.q_norm.scale"),
    _Rule("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.self_attn.k_norm.scale"),
    _Rule("model.layers.{i}.self_attn.{proj}.weight", "layers.{i}.self_attn.{proj}.kernel", True),
    # q/k/v_proj (qkv_bias) and o_proj (o_bias); the config decides which must be there.
    _Rule("model.layers.{i}.self_attn.{proj}.bias", "layers.{i}.self_attn.{proj}.bias"),
    _Rule(
        "model.layers.{i}.post_attention_layernorm.weight",
        "layers.{i}.post_attention_layernorm.scale",
    ),
    _Rule("model.layers.{i}.mlp.{proj}.weight", "layers.{i}.mlp.{proj}.kernel", True),
    _Rule("model.norm.weight", "norm.scale"),
    _Rule("lm_head.weight", "lm_head.kernel", True),
)
_IGNORED = (re.compile(r"(.+\.)?rotary_emb\.inv_freq"),)
# Tensors of quantized formats beside (or in place of) a `weight`: GPTQ/AWQ, FP8
# (weight_scale, input_scale; weight_scale_inv for block scales), compressed-tensors,
# bitsandbytes (int8's SCB; 4-bit's absmax, quant_map, quant_state.*).
_QUANTIZED = re.compile(
    r"(^|\.)(qweight|qzeros|scales|g_idx|weight_scale|weight_scale_inv|input_scale|"
    r"weight_zero_point|weight_packed|weight_shape|weight_g_idx|SCB|absmax|quant_map|"
    r"nested_absmax|nested_quant_map|quant_state\.[\w.]+)$"
)
_TIED_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"
_EMBED_PATH = "embed_tokens.embedding"
_COMPARE_BYTES = 64 << 20  # per block of rows when comparing a tied head with the embedding


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)
    body = "".join(
        re.escape(p) if k % 2 == 0 else rf"(?P<{p}>[A-Za-z0-9_]+)" for k, p in enumerate(parts)
    )
    return re.compile(body)


_HF_RES = tuple((_template_regex(r.hf), r) for r in _RULES)
_OUR_RES = tuple((_template_regex(r.ours), r) for r in _RULES)


def hf_to_path(name: str) -> tuple[str, bool] | None:
    """(our dotted path, transpose) for an HF tensor name, or None if no rule matches."""
    for regex, rule in _HF_RES:
        if m := regex.fullmatch(name):
            return rule.ours.format(**m.groupdict()), rule.transpose
    return None


def path_to_hf(path: str) -> tuple[str, bool]:
    """(HF tensor name, transpose) for one of our dotted parameter paths."""
    for regex, rule in _OUR_RES:
        if m := regex.fullmatch(path):
            return rule.hf.format(**m.groupdict()), rule.transpose
    raise ValueError(f"no HF name rule for parameter path {path!r}")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; lists every problem at once.

    Attributes:
      missing: HF names the config needs and the checkpoint lacks.
      unexpected: HF names in the checkpoint that the config has no place for.
      problems: every problem as one line (shape and dtype mismatches included).
    """

    def __init__(
        self, where: str, missing, unexpected, other, *, what="does not match its config", hint=""
    ):
        self.missing, self.unexpected = list(missing), list(unexpected)
        self.problems = (
            [f"missing: {m}" for m in self.missing]
            + [f"unexpected: {u}" for u in self.unexpected]
            + list(other)
        )
        lines = [f"{where} {what} ({len(self.problems)} problems):"]
        for kind, items in (("missing", self.missing), ("unexpected", self.unexpected)):
            lines += [f"  {kind}: {x}" for x in items[:_MAX_LISTED]]
            if len(items) > _MAX_LISTED:
                lines.append(f"  ... and {len(items) - _MAX_LISTED} more {kind}")
        lines += [f"  {x}" for x in other]
        if hint:  # (what to do: not one of the problems)
            lines.append(hint)
        super().__init__("\n".join(lines))


def _leaves_directory(fname: str) -> bool:
    """Whether a path from a checkpoint directory points outside it: absolute, or with a
    ".." part."""
    return fname.startswith("/") or ".." in fname.split("/")


def _checkpoint_files(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of an HF directory and the index's weight map, if any.

    The index's files when there is one (it wins over a `model.safetensors` beside it, as
    in vLLM; transformers' from_pretrained would take the single file), else
    `model.safetensors`, else every `*.safetensors` in the directory.
    """
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' object")
        bad = {k: v for k, v in weight_map.items() if not isinstance(v, str)}
        if bad:
            raise ValueError(f"{index}: weight_map must map names to file names, got {bad}")
        # A shard is a path from the directory ("x", "./x", "sub/x"); one that leaves it
        # ("../x", "/x") would load another checkpoint's file, or any file, as this one's.
        outside = sorted({f for f in weight_map.values() if _leaves_directory(f)})
        if outside:
            raise ValueError(
                f"{index}: weight_map names shard files outside the checkpoint directory: "
                f"{', '.join(map(repr, outside[:3]))}"
            )
        return sorted({root / f for f in weight_map.values()}), weight_map
    if (root / SAFETENSORS_FILE).is_file():
        return [root / SAFETENSORS_FILE], None
    files = sorted(root.glob("*.safetensors"))
    pickles = sorted(p.name for p in root.glob("*.bin") if p.name.startswith("pytorch_model"))
    if not files and pickles:
        raise FileNotFoundError(
            f"{root} has PyTorch pickle weights ({', '.join(pickles[:3])}), which pagedjax "
            "does not read: download the repo's *.safetensors files instead, or convert them "
            "(transformers: from_pretrained, then save_pretrained(..., safe_serialization=True))"
        )
    if not files:
        raise FileNotFoundError(
            f"no weights in {root}: expected {SAFETENSORS_FILE}, {INDEX_FILE} or *.safetensors"
        )
    return files, None


def _scan(root: Path) -> tuple[dict[str, _TensorInfo], list[str]]:
    """All tensors of an HF directory by name, and problems with the files themselves."""
    files, weight_map = _checkpoint_files(root)
    tensors: dict[str, _TensorInfo] = {}
    problems, broken = [], []
    for file in files:
        if file.is_symlink() and not file.exists():  # a hub-cache blob deleted
            broken.append(f"{file.name} is a broken symlink (to {file.readlink()})")
            continue
        if not file.is_file():
            named = f" (named in {INDEX_FILE})" if weight_map is not None else ""
            broken.append(f"missing shard file: {file.name}{named}")
            continue
        try:
            header = _read_header(file)
        except ValueError as e:
            broken.append(str(e))
            continue
        for name, info in header.items():
            if name in tensors:
                problems.append(
                    f"duplicate tensor {name} in {tensors[name].file.name}, {file.name}"
                )
            tensors[name] = info
    for name, fname in (weight_map or {}).items():
        info = tensors.get(name)  # a path from root ("./x" is "x", as in HF), not a file name
        if (root / fname).is_file() and (info is None or info.file != root / fname):
            problems.append(f"index error: {INDEX_FILE} puts {name} in {fname}, which lacks it")
    if broken:  # not "missing" every tensor of an unreadable file: name the file alone
        raise CheckpointError(f"HF checkpoint {root}", [], [], broken, what="has broken files")
    return tensors, problems


def _plan(root: Path, cfg: ModelConfig):
    """Pass 1: maps every tensor and checks shapes/dtypes. Returns (plan, tied_head info)."""
    tensors, other = _scan(root)
    shapes = {k: tuple(v.shape) for k, v in param_shapes(cfg).items()}
    plan: dict[str, tuple[_TensorInfo, bool]] = {}  # our path -> (tensor, transpose)
    unexpected, quantized, tied_head = [], [], None
    for name, info in sorted(tensors.items()):
        mapped = hf_to_path(name)
        if name == _TIED_HEAD and cfg.tie_embeddings:
            tied_head = info
            expected = (cfg.vocab_size, cfg.hidden_size)
        elif mapped is None or mapped[0] not in shapes:
            if not any(p.fullmatch(name) for p in _IGNORED):
                unexpected.append(f"{name} {list(info.shape)}")
                if _QUANTIZED.search(name):
                    quantized.append(name)
            continue
        else:
            path, transpose = mapped
            expected = shapes[path][::-1] if transpose else shapes[path]
            plan[path] = (info, transpose)
        if info.shape != expected:
            other.append(
                f"shape mismatch: {name}: checkpoint has {list(info.shape)}, "
                f"config expects {list(expected)}"
            )
        if info.dtype not in _ST_DTYPES:
            other.append(f"unsupported dtype: {name} is {info.dtype}, not {sorted(_ST_DTYPES)}")
    missing = []
    for path in sorted(set(shapes) - set(plan)):
        hf, transpose = path_to_hf(path)
        missing.append(f"{hf} {list(shapes[path][::-1] if transpose else shapes[path])}")
    if not cfg.tie_embeddings and "lm_head.kernel" not in plan:
        other.append(
            "hint: config.json has tie_word_embeddings=false but there is no lm_head.weight; "
            "a tied model should say tie_word_embeddings=true"
        )
    what = "does not match its config"
    if quantized:  # the cause of the missing weights listed below, first
        names = ", ".join(quantized[:2]) + (", ..." if len(quantized) > 2 else "")
        what = (
            f"is quantized ({names}), which pagedjax does not load: use the unquantized "
            "(bf16/fp16/fp32) checkpoint"
        )
    if missing or unexpected or other:
        raise CheckpointError(f"HF checkpoint {root}", missing, unexpected, other, what=what)
    return plan, tied_head


def load_hf_checkpoint(path, *, dtype=None) -> tuple[ModelConfig, Params]:
    """Loads an HF Llama-family checkpoint directory.

    Args:
      path: directory with config.json and model.safetensors or sharded safetensors
        plus model.safetensors.index.json.
      dtype: parameter dtype ("bfloat16", "float32", ...); default from config.json.

    Returns:
      (config, params) with every parameter on the default device in `config.dtype`.

    Raises:
      FileNotFoundError: the directory, config.json or the weight files are missing.
      CheckpointError: (a ValueError) missing, unexpected or mis-shaped tensors, all
        listed at once; checked from the file headers before any tensor is read. Also
        a tied model's `lm_head.weight` that differs from the embedding, checked before
        any other tensor is read; and, loading in float16, every tensor holding values
        beyond float16's range (found as the tensors are read, listed at the end).
      ValueError: an index whose weight_map is not names -> shard paths inside the
        directory.
    """
    root = _checkpoint_dir(path)
    cfg_file = root / CONFIG_FILE
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{root} is not an HF checkpoint: it has no {CONFIG_FILE}")
    cfg = ModelConfig.from_hf(read_json_object(cfg_file), dtype=dtype)
    plan, tied_head = _plan(root, cfg)
    target = np.dtype(cfg.jnp_dtype)
    # Before the long pass 2: a tied model's extra head must equal the embedding.
    if tied_head is not None and not _same_values(tied_head, plan[_EMBED_PATH][0], target):
        raise CheckpointError(
            f"HF checkpoint {root}",
            [],
            [],
            [
                f"config.json has tie_word_embeddings=true but {_TIED_HEAD} differs from "
                f"{_EMBED}; set tie_word_embeddings=false to use the separate head"
            ],
        )
    by_file: dict[Path, list[tuple[str, _TensorInfo, bool]]] = {}
    for our, (info, transpose) in plan.items():
        by_file.setdefault(info.file, []).append((our, info, transpose))
    flat, overflows = {}, []
    for file, items in sorted(by_file.items()):
        flat.update(_load_shard(file, items, target, overflows))
    if overflows:
        raise CheckpointError(
            f"HF checkpoint {root}",
            [],
            [],
            overflows,
            what="does not fit in float16",
            hint="load it in bfloat16 or float32 (dtype=...), which hold these values",
        )
    return cfg, params_from_flat(cfg, flat)


def _same_values(a: _TensorInfo, b: _TensorInfo, target: np.dtype) -> bool:
    """Whether two tensors of one shape are equal once cast to `target`.

    Reads both from their files through memory maps, `_COMPARE_BYTES` of rows at a time.
    A NaN equals a NaN: a head copied from an embedding with a NaN in it is that embedding.
    """
    x, y = (np.memmap(i.file, _ST_DTYPES[i.dtype], "r", i.start, i.shape) for i in (a, b))
    step = max(1, _COMPARE_BYTES // max(1, x[:1].nbytes))
    return all(
        np.array_equal(
            x[r : r + step].astype(target), y[r : r + step].astype(target), equal_nan=True
        )
        for r in range(0, len(x), step)
    )


def _load_shard(file: Path, items, target: np.dtype, overflows: list) -> dict[str, jax.Array]:
    """Pass 2 for one file: one tensor in host memory at a time, then onto the device.

    A tensor goes to the device as stored and is cast and transposed there: numpy's
    strided copy of a transposed bf16 matrix took ~65% of a load on the CPU (a GPU
    transposes it in a few microseconds). One already in our dtype and layout is not
    passed through jit, which would copy it. Appends to `overflows` a line for each
    tensor with values that `target` float16 cannot hold.
    """
    out = {}
    with open(file, "rb") as f:
        for our, info, transpose in items:
            x = _read_tensor(f, info)
            if x.dtype == np.float64:  # no float64 on the device (jax casts it to float32)
                x = x.astype(np.float32 if target == _F16 else target)
            x = jax.device_put(x)
            if target == _F16 and x.dtype != _F16:
                count, largest = _f16_overflow(x)
                if count:
                    overflows.append(
                        f"float16 overflow: {info.name} ({info.dtype}) has {int(count)} values "
                        f"beyond float16's range, up to |x| = {float(largest):.4g}"
                    )
            out[our] = _to_device(x, transpose, target) if transpose or x.dtype != target else x
            del x
    return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def _to_device(x: jax.Array, transpose: bool, target: np.dtype) -> jax.Array:
    """A loaded tensor in our layout: cast to `target`, transposed if the rule says so."""
    x = x.astype(target)
    return x.T if transpose else x


@jax.jit
def _f16_overflow(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(count, largest |x|) of the finite values of `x` that become inf in float16."""
    bad = jnp.isfinite(x) & jnp.isinf(x.astype(jnp.float16))
    return bad.sum(), jnp.max(jnp.where(bad, jnp.abs(x), 0)).astype(jnp.float32)


def save_hf_checkpoint(params: Params, cfg: ModelConfig, path, *, shard_size_bytes=None) -> None:
    """Writes params as an HF directory: config.json, safetensors, and an index if sharded.

    Tensors keep the params' dtype. Any `model*.safetensors` and index already in the
    directory are removed first, so a stale shard can never shadow the new files.

    Args:
      params: the model to save.
      cfg: its config; written as config.json (`cfg.to_hf()`).
      path: output directory (created if needed).
      shard_size_bytes: start a new shard when the current one would exceed this many
        bytes (one tensor larger than this gets a shard of its own); None: one file.
    """
    if shard_size_bytes is not None and shard_size_bytes <= 0:
        raise ValueError(f"shard_size_bytes must be positive, got {shard_size_bytes=}")
    flat = params_to_flat(params)
    expected = {k: tuple(v.shape) for k, v in param_shapes(cfg).items()}
    got = {k: tuple(v.shape) for k, v in flat.items()}
    if got != expected:
        diff = sorted(set(got.items()) ^ set(expected.items()))
        raise ValueError(f"params do not match cfg; differing (path, shape): {diff[:10]}")
    # Everything that can fail on the params (a deleted array) or the config, before the
    # old files go: a failed save must not leave the directory without a checkpoint.
    config_text = json.dumps(cfg.to_hf(), indent=2) + "\n"
    shards: list[dict[str, np.ndarray]] = [{}]
    size = total = 0
    for our, value in flat.items():
        name, transpose = path_to_hf(our)
        x = np.asarray(value)
        x = np.ascontiguousarray(x.T if transpose else x)
        if shard_size_bytes and shards[-1] and size + x.nbytes > shard_size_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
        total += x.nbytes
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for old in [*root.glob("model*.safetensors"), root / INDEX_FILE]:
        old.unlink(missing_ok=True)
    (root / CONFIG_FILE).write_text(config_text)
    if len(shards) == 1:
        save_file(shards[0], str(root / SAFETENSORS_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


# ----------------------------------------------------------------------------- dispatch


def checkpoint_format(path) -> str:
    """ "hf" or "orbax" for a checkpoint directory; errors say what is missing."""
    root = _checkpoint_dir(path)
    if (root / ORBAX_META_FILE).is_file():
        return "orbax"
    if (root / CONFIG_FILE).is_file():
        return "hf"
    if any(root.glob("*.safetensors")) or (root / INDEX_FILE).is_file():
        raise FileNotFoundError(f"{root} has safetensors weights but no {CONFIG_FILE}")
    if (root / ORBAX_PARAMS_DIR).is_dir():
        raise FileNotFoundError(f"{root} has {ORBAX_PARAMS_DIR}/ but no {ORBAX_META_FILE}")
    snapshots = sorted(p for p in root.glob("snapshots/*") if (p / CONFIG_FILE).is_file())
    if snapshots:
        raise FileNotFoundError(
            f"{root} is a HuggingFace hub cache folder; pass a snapshot directory in it: "
            + ", ".join(str(p) for p in snapshots)
        )
    found = sorted(p.name for p in root.iterdir())[:10]
    raise FileNotFoundError(
        f"{root} is neither an HF checkpoint ({CONFIG_FILE} + *.safetensors) nor a pagedjax "
        f"orbax checkpoint ({ORBAX_META_FILE} + {ORBAX_PARAMS_DIR}/); it holds {found}"
    )


def _checkpoint_dir(path) -> Path:
    """`path` as a directory; a file or nothing there is a FileNotFoundError saying so."""
    root = Path(path)
    if root.is_file():
        raise FileNotFoundError(
            f"{root} is a file; a checkpoint is the directory holding it and its "
            f"{CONFIG_FILE}: {root.parent}"
        )
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    return root


def read_checkpoint_config(path) -> ModelConfig:
    """The config of either kind of checkpoint directory, read without its weights (in
    the dtype it loads in by default)."""
    if checkpoint_format(path) == "hf":
        return ModelConfig.from_hf(read_json_object(Path(path) / CONFIG_FILE))
    return read_orbax_config(path)


def load_checkpoint(path, *, dtype=None) -> tuple[ModelConfig, Params]:
    """Loads either kind of checkpoint directory (see `checkpoint_format`).

    Returns:
      (config, params).
    """
    if checkpoint_format(path) == "hf":
        return load_hf_checkpoint(path, dtype=dtype)
    params = restore_params(path, dtype=dtype)
    return params.config, params
