"""Orbax checkpoints of pagedjax params: save and restore, config included.

Layout (`save_params` / `restore_params`), a directory holding:

    pagedjax_checkpoint.json   {"format": "pagedjax.orbax", "version": 1, "config": {...}}
    params/                    orbax StandardCheckpointer tree, nested like the dotted
                               paths of `params_to_flat` (layers -> "0" -> self_attn ...)

The config JSON is exactly the `ModelConfig` fields, so a restore needs no other
argument; the JSON is written last and marks a complete checkpoint. A restore checks
the stored arrays' shapes (orbax's metadata) against that config before it reads any
array, and refuses a `cfg` that describes another model than the stored one. HF
checkpoints and `load_checkpoint`, which takes either kind, are in `pagedjax.weights`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import ModelConfig, RopeScaling
from pagedjax.jsonfile import read_json_object
from pagedjax.model import Params, param_shapes, params_from_flat, params_to_flat
from pagedjax.sharding import default_device

__all__ = [
    "ORBAX_META_FILE",
    "ORBAX_PARAMS_DIR",
    "config_from_json",
    "config_to_json",
    "read_orbax_config",
    "restore_params",
    "save_params",
]

ORBAX_META_FILE = "pagedjax_checkpoint.json"
ORBAX_PARAMS_DIR = "params"
_ORBAX_FORMAT = "pagedjax.orbax"
_ORBAX_VERSION = 1
# What the stored arrays are: a cfg given to restore_params must agree on these. The
# other fields (dtype, context, RoPE, window, eps, token ids) say how they run.
_ARRAY_FIELDS = (
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "tie_embeddings",
    "qkv_bias",
    "o_bias",
    "qk_norm",
)
_MAX_LISTED = 40  # problem lines per error
# Bytes of arrays one orbax restore call reads (a larger array is read alone). A call
# reads all its arrays at once, each through a host buffer beside its device copy: one
# call for the whole tree peaked at ~1.5-1.8x the checkpoint on the CPU (BENCHMARKS.md).
_RESTORE_GROUP_BYTES = 1 << 30


def config_to_json(cfg: ModelConfig) -> dict:
    """All `ModelConfig` fields as a JSON-able dict (exact, unlike the HF form)."""
    return dataclasses.asdict(cfg)


def config_from_json(d: dict) -> ModelConfig:
    """Inverse of `config_to_json`; unknown fields are an error."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"unknown ModelConfig fields {unknown} in the stored config")
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = _rope_scaling_from_json(d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    return ModelConfig(**d)


def _rope_scaling_from_json(d: dict) -> RopeScaling:
    """A stored `RopeScaling`; one without `rope_type` was saved when llama3 was the only
    kind (its fields then: factor, low/high_freq_factor, original_max_position_embeddings)."""
    d = {"rope_type": "llama3", **d}
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(RopeScaling)})
    if unknown:
        raise ValueError(f"unknown RopeScaling fields {unknown} in the stored config: {d}")
    return RopeScaling(**d)


def _nest(flat: dict) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _unnest(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_unnest(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def save_params(params: Params, path, *, overwrite: bool = False, extra_files=()) -> None:
    """Saves params and their config as an orbax checkpoint directory (layout above).

    The checkpoint is written into a new directory beside `path` and moved into place
    only once complete, so an interrupted or failed save leaves whatever was at `path`
    as it was (and no partial checkpoint there).

    Args:
      params: the model; its `config` is stored beside the arrays.
      path: the checkpoint directory; must not exist (or be empty) unless `overwrite`.
        A symlink's target is written (the link kept); the directory keeps its mode, or
        a new one gets the umask's (not a temporary directory's 0700).
      overwrite: replace an existing pagedjax orbax checkpoint at `path`. A non-empty
        directory that is not one is never removed.
      extra_files: paths of files (or directories, copied whole) copied into the
        checkpoint under their own names before it moves into place (a tokenizer's),
        so they arrive with it or not at all. Two with one name, or one named as the
        checkpoint's own files, are a ValueError; a missing one a FileNotFoundError,
        before any array is written.

    Raises:
      TypeError: `params` is not a `Params` (the (config, params) pair of
        `load_checkpoint`), or `extra_files` is one path rather than a list of them.
    """
    import orbax.checkpoint as ocp  # slow import; only here

    if not isinstance(params, Params):
        raise TypeError(
            "params must be pagedjax.model.Params (load_checkpoint returns (config, "
            f"params): pass the second), got {type(params).__name__}"
        )
    if isinstance(extra_files, (str, bytes, os.PathLike)):  # (a str iterates by character)
        raise TypeError(
            f"extra_files must be a list of paths, got {type(extra_files).__name__} "
            f"{extra_files!r:.200}: pass [path]"
        )
    extra = [Path(f) for f in extra_files]
    gone = [str(f) for f in extra if not f.exists()]
    if gone:  # (found by the copy only after every array was written)
        raise FileNotFoundError(f"extra_files: no such file: {', '.join(gone)}")
    names = [f.name for f in extra]
    clash = sorted(
        {n for n in names if names.count(n) > 1 or n in (ORBAX_PARAMS_DIR, ORBAX_META_FILE)}
    )
    if clash:
        raise ValueError(f"extra_files: {clash} named twice or as the checkpoint's own files")
    root = Path(path).resolve()  # a symlink's target is replaced, not the link
    replace = root.exists() and any(root.iterdir())
    if replace:
        if not overwrite:
            raise FileExistsError(f"{root} exists and is not empty (pass overwrite=True)")
        if not (root / ORBAX_META_FILE).is_file():
            raise FileExistsError(f"refusing to overwrite {root}: not a pagedjax checkpoint")
    root.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{root.name}.saving-", dir=root.parent))
    # mkdtemp's 0700 would shut other users (a server's) out: root's mode, else the umask's
    umask = os.umask(0)
    os.umask(umask)
    new.chmod(stat.S_IMODE(root.stat().st_mode) if root.is_dir() else 0o777 & ~umask)
    old = new.with_name(new.name.replace(".saving-", ".replaced-"))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(new / ORBAX_PARAMS_DIR, _nest(params_to_flat(params)))
        meta = {
            "format": _ORBAX_FORMAT,
            "version": _ORBAX_VERSION,
            "config": config_to_json(params.config),
        }
        (new / ORBAX_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        for f in extra:
            if f.is_dir():  # (additional_chat_templates/)
                shutil.copytree(f, new / f.name)
            else:
                shutil.copy2(f, new / f.name)
        if replace:
            root.rename(old)
            try:
                new.rename(root)
            except BaseException:
                old.rename(root)
                raise
        else:
            if root.exists():
                root.rmdir()  # empty
            new.rename(root)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    if replace:
        shutil.rmtree(old, ignore_errors=True)


def read_orbax_config(path) -> ModelConfig:
    """The config stored in a pagedjax orbax checkpoint directory.

    Raises:
      FileNotFoundError: no pagedjax_checkpoint.json there.
      ValueError: naming that file, when it is not JSON, not a version 1 pagedjax
        checkpoint's, or holds no valid config.
    """
    root = Path(path)
    meta_file = root / ORBAX_META_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(f"{root} is not a pagedjax orbax checkpoint: no {ORBAX_META_FILE}")
    meta = read_json_object(meta_file)
    if meta.get("format") != _ORBAX_FORMAT or meta.get("version") != _ORBAX_VERSION:
        raise ValueError(
            f"{meta_file}: unsupported format {meta.get('format')!r} version "
            f"{meta.get('version')!r}; expected {_ORBAX_FORMAT!r} version {_ORBAX_VERSION}"
        )
    if not isinstance(meta.get("config"), dict):
        raise ValueError(f'{meta_file} has no "config" object')
    try:
        return config_from_json(meta["config"])
    except (TypeError, ValueError) as e:  # e.g. a missing field, or a bad value
        raise ValueError(f"{meta_file}: bad config: {e}") from None


def restore_params(path, cfg: ModelConfig | None = None, *, dtype=None) -> Params:
    """Restores params saved by `save_params` onto the default device (`jax.default_device`
    if set, else the first device).

    Args:
      path: the checkpoint directory.
      cfg: the config to build the model with; default the stored one. It may change
        how the arrays run (dtype, eos ids, RoPE, ...), not what they are: the fields
        in `_ARRAY_FIELDS` must equal the stored config's.
      dtype: shorthand for `dataclasses.replace(cfg, dtype=dtype)`.

    Raises:
      TypeError: a `cfg` that is not a `ModelConfig` (a dtype given in its place).
      ValueError: before any array is read, naming each one: a `cfg` of another model
        than the stored one (the fields and both values), stored arrays that do not
        fit the stored config (each array and both shapes). After the read, restoring
        in float16, the arrays holding values beyond float16's range (a cast makes
        them inf; as `pagedjax.weights.load_hf_checkpoint` does). A params/ folder
        without readable metadata (before the read) or with damaged array files (when
        read), naming the folder (and the array, as orbax's cause names it).
    """
    import orbax.checkpoint as ocp

    if cfg is not None and not isinstance(cfg, ModelConfig):  # (a dtype given as cfg)
        raise TypeError(
            f"cfg must be a ModelConfig or None, got {type(cfg).__name__} {cfg!r:.80}"
            + ("; a dtype goes in dtype=" if isinstance(cfg, str) else "")
        )
    root = Path(path).absolute()
    stored = read_orbax_config(root)
    params_dir = root / ORBAX_PARAMS_DIR
    if not params_dir.is_dir():
        raise FileNotFoundError(f"{root} has {ORBAX_META_FILE} but no {ORBAX_PARAMS_DIR}/")
    cfg = cfg or stored
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    differ = [
        f"{f}={getattr(cfg, f)!r} (stored {getattr(stored, f)!r})"
        for f in _ARRAY_FIELDS
        if getattr(cfg, f) != getattr(stored, f)
    ]
    if differ:
        raise ValueError(
            f"{root} was saved for another model than cfg: {', '.join(differ)}; a cfg "
            "may change how the stored arrays run (dtype, eos ids, RoPE, ...), not what they are"
        )
    shapes = {k: tuple(v.shape) for k, v in param_shapes(stored).items()}
    # An explicit target puts arrays on this machine's default device (the host under
    # `sharding.host_staging`, for a model to be split), whatever saved them, in cfg's
    # dtype: orbax casts as it reads (a restore then a cast held both copies).
    sharding = jax.sharding.SingleDeviceSharding(default_device())
    target = {
        k: jax.ShapeDtypeStruct(s, cfg.jnp_dtype, sharding=sharding) for k, s in shapes.items()
    }
    with ocp.PyTreeCheckpointer() as ckptr:
        on_disk = _stored_arrays(ckptr, params_dir)
        _check_stored_shapes(on_disk, shapes, params_dir, root / ORBAX_META_FILE)
        # (an orbax without partial restores reads the whole tree in one call)
        partial = "partial_restore" in inspect.signature(ocp.args.PyTreeRestore).parameters
        groups = _restore_groups(target, _RESTORE_GROUP_BYTES) if partial else [target]
        flat = {}
        for group in groups:
            restore_args = {
                k: ocp.ArrayRestoreArgs(sharding=sharding, dtype=v.dtype, global_shape=v.shape)
                for k, v in group.items()
            }
            args = ocp.args.PyTreeRestore(
                item=_nest(group),
                restore_args=_nest(restore_args),
                **({"partial_restore": True} if partial else {}),
            )
            try:
                flat.update(_unnest(ckptr.restore(params_dir, args=args)))
            except MemoryError:
                raise
            except Exception as e:  # orbax's: a page of TensorStore spec; its cause names
                cause = str(e.__cause__ or e)  # the array and the file
                raise ValueError(
                    f"{params_dir} is damaged: {cause[:500]}; save the checkpoint again"
                ) from e
    if cfg.dtype == "float16":
        _check_f16(flat, on_disk, root)
    return params_from_flat(cfg, flat)


def _restore_groups(target: dict, max_bytes: int) -> list[dict]:
    """`target` ({dotted path: ShapeDtypeStruct}) split, in order, into groups of at
    most `max_bytes` (in the target dtype); an array larger than that forms its own."""
    groups: list[dict] = [{}]
    size = 0
    for k, v in target.items():
        nbytes = v.size * v.dtype.itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][k] = v
        size += nbytes
    return groups


def _stored_arrays(ckptr, params_dir: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{dotted path: (shape, dtype)} of the arrays under `params_dir`, from orbax's
    metadata alone (no array is read)."""
    meta = ckptr.metadata(params_dir)
    tree = getattr(meta, "item_metadata", meta)  # orbax 0.12: StepMetadata, then
    tree = getattr(tree, "tree", tree)  # TreeMetadata around the nested dict
    if not isinstance(tree, Mapping):  # orbax logs a warning and returns None
        raise ValueError(
            f"{params_dir} has no readable orbax metadata (its _METADATA file is missing "
            "or damaged; was it copied in part?): save the checkpoint again"
        )
    return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in _unnest(dict(tree)).items()}


def _check_stored_shapes(on_disk: dict, shapes: dict, params_dir: Path, meta_file: Path):
    """ValueError naming every array of `params_dir` that the stored config (`shapes`)
    lacks, has no array for, or expects in another shape."""
    problems = [f"missing: {k} {list(s)}" for k, s in shapes.items() if k not in on_disk]
    problems += [f"unexpected: {k} {list(s)}" for k, (s, _) in on_disk.items() if k not in shapes]
    problems += [
        f"shape mismatch: {k}: stored {list(on_disk[k][0])}, config expects {list(s)}"
        for k, s in shapes.items()
        if k in on_disk and on_disk[k][0] != s
    ]
    if problems:
        more = len(problems) - _MAX_LISTED
        lines = problems[:_MAX_LISTED] + ([f"... and {more} more"] if more > 0 else [])
        raise ValueError(
            f"{params_dir} does not match the config in {meta_file} ({len(problems)} "
            "problems; was one of them copied from another checkpoint?):\n  " + "\n  ".join(lines)
        )


def _check_f16(flat: dict, on_disk: dict, root: Path) -> None:
    """ValueError naming each array that orbax's cast to float16 made inf (it was not
    float16 on disk), so that no model runs on infs it did not have."""
    problems = []
    for k, x in flat.items():
        if on_disk[k][1] != np.float16 and (count := int(jnp.isinf(x).sum())):
            problems.append(
                f"float16 overflow: {k} has {count} values beyond float16's range "
                f"(stored as {on_disk[k][1]})"
            )
    if problems:
        raise ValueError(
            f"{root} does not fit in float16:\n  "
            + "\n  ".join(
                [*problems, "restore it in bfloat16 or float32 (dtype=...), which hold them"]
            )
        )
