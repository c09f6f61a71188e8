"""Converts a HuggingFace checkpoint directory into a pagedjax orbax checkpoint.

    python scripts/convert_checkpoint.py HF_DIR OUT_DIR [--dtype bfloat16] [--overwrite]
        [--merge-lora ADAPTER_DIR]

Tokenizer files found in HF_DIR (tokenizer.json, tokenizer_config.json,
generation_config.json, special_tokens_map.json, and chat templates kept in their own
files: chat_template.jinja, chat_template.json, and the named ones, tool_use among
them, in additional_chat_templates/) are copied beside the orbax
checkpoint so that OUT_DIR is enough to serve the model (`generate.py --chat`
included); without tokenizer.json it says so, since OUT_DIR then serves token-id
prompts only. Converting back (orbax to HF) is not supported: an orbax HF_DIR is an
error.

`--merge-lora ADAPTER_DIR` folds a PEFT LoRA adapter into the weights
(`pagedjax.lora.merge_adapter`: `W + scaling * A.T @ B.T`, summed in float32): OUT_DIR
then serves the adapted model with no LoRA at run time. The adapter is read and
checked against HF_DIR's config before the model loads.

Bad input (a missing or broken HF_DIR, a refused OUT_DIR, one in a directory it may not
write in) ends with one line on stderr and exit status 2, as generate.py's does; failing
to write OUT_DIR (a full disk) with status 1, and a Ctrl-C with status 130: either leaves
OUT_DIR as it was (the checkpoint is written beside it and moved into place whole).
OUT_DIR a symlink: the checkpoint it points to is replaced, the link kept.
`--overwrite` replaces OUT_DIR whole: files put there since (an adapter) go with the old
checkpoint. A conversion killed mid-write (SIGKILL, the OOM killer) leaves its hidden
`.NAME.saving-*` directory beside OUT_DIR: the next conversion to OUT_DIR names such
leftovers and their size (not removing them: one may be a conversion still running).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import sys
import time
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
TOKENIZER_DIRS = ("additional_chat_templates",)  # transformers' NAME.jinja templates


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuses OUT_DIR up front, as `weights.save_params` would after the whole load."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR {out} exists and is not a directory")
    above = next(p for p in out.absolute().parents if p.exists())  # (the root exists)
    if not above.is_dir():
        raise ValueError(f"OUT_DIR {out} cannot be made: {above} is not a directory")
    if not os.access(above, os.W_OK | os.X_OK):  # the checkpoint is made in it, then moved
        raise ValueError(f"OUT_DIR {out} cannot be made: cannot write in {above}")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(
                f"OUT_DIR {out} exists and is not empty; pass --overwrite to replace it"
            )
        from pagedjax.orbax_checkpoint import ORBAX_META_FILE

        if not (out / ORBAX_META_FILE).is_file():
            raise ValueError(
                f"refusing to overwrite OUT_DIR {out}: not a pagedjax checkpoint "
                f"(no {ORBAX_META_FILE}), so --overwrite does not remove it"
            )


def leftovers(out: Path) -> list[Path]:
    """The directories that saves to `out` killed mid-write (SIGKILL, the OOM killer)
    left beside it (`save_params` writes `.NAME.saving-*` and moves it into place, and
    keeps the old one as `.NAME.replaced-*` until the new one is there)."""
    root = out.resolve()
    name = glob.escape(root.name)
    found = [*root.parent.glob(f".{name}.saving-*"), *root.parent.glob(f".{name}.replaced-*")]
    return sorted(p for p in found if p.is_dir() and not p.is_symlink())


def note_leftovers(out: Path) -> None:
    """One line on stderr naming `leftovers(out)` and their size, if any (not removed: one
    may be a conversion still running)."""
    found = leftovers(out)
    if not found:
        return
    size = 0
    for d, _, files in (w for p in found for w in os.walk(p)):
        for f in files:
            with contextlib.suppress(OSError):  # (one a running conversion just moved)
                size += (Path(d) / f).lstat().st_size
    print(
        f"convert_checkpoint: note: {', '.join(map(str, found))} ({size / 2**30:.2f} GiB) "
        f"left by an interrupted conversion to {out}; remove them unless one is still running",
        file=sys.stderr,
    )


def one_line(e: BaseException) -> str:
    """`e`'s message on one line (the loader lists each broken file on a line of its own)."""
    return " ".join(str(e).split())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint.py",
        description="HF safetensors checkpoint directory -> pagedjax orbax checkpoint.",
    )
    parser.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    parser.add_argument("out_dir", help="orbax checkpoint directory to write")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32", "float16"),
        help="parameter dtype (default: as the HF directory loads: float32 for a checkpoint "
        "whose config.json dtype (or torch_dtype) says float32; float16 and bfloat16 "
        "checkpoints: bfloat16, the dtype the kernels are tuned in)",
    )
    parser.add_argument(
        "--merge-lora",
        metavar="ADAPTER_DIR",
        help="fold this PEFT LoRA adapter directory into the weights",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a pagedjax checkpoint at OUT_DIR (any other non-empty OUT_DIR is refused)",
    )
    args = parser.parse_args(argv)

    from pagedjax import lora, weights  # argparse errors before the jax import
    from pagedjax.model import params_to_flat
    from pagedjax.orbax_checkpoint import ORBAX_META_FILE

    start = time.perf_counter()
    try:
        hf, out = Path(args.hf_dir).resolve(), Path(args.out_dir).resolve()
        if hf == out or out in hf.parents:  # --overwrite would delete the source
            raise ValueError(
                f"OUT_DIR must not be HF_DIR or contain it, got OUT_DIR {args.out_dir} "
                f"and HF_DIR {args.hf_dir}"
            )
        if (hf / ORBAX_META_FILE).is_file():
            raise ValueError(
                f"HF_DIR {args.hf_dir} is a pagedjax orbax checkpoint already: serve it as "
                "it is (--checkpoint); converting back to HF safetensors is not supported"
            )
        check_out_dir(Path(args.out_dir), args.overwrite)  # before a load of many GB
        adapter = None
        if args.merge_lora is not None:  # also before the load
            adapter = lora.load_adapter(args.merge_lora, weights.read_checkpoint_config(hf))
        cfg, params = weights.load_hf_checkpoint(args.hf_dir, dtype=args.dtype)
        if adapter is not None:
            params = lora.merge_adapter(params, adapter)
    except KeyboardInterrupt:
        print(f"convert_checkpoint: interrupted; {args.out_dir} not written", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError) as e:
        print(f"convert_checkpoint: error: {one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # (reading HF_DIR's files)
        print(f"convert_checkpoint: error: {one_line(e)}", file=sys.stderr)
        return 1
    copied = [name for name in TOKENIZER_FILES if (Path(args.hf_dir) / name).is_file()]
    copied += [name for name in TOKENIZER_DIRS if (Path(args.hf_dir) / name).is_dir()]
    try:  # OUT_DIR was checked: what fails now is the write (orbax's full disk: a ValueError)
        # (the tokenizer files go in before the checkpoint moves into place: with it or not)
        extra = [Path(args.hf_dir) / name for name in copied]
        weights.save_params(params, args.out_dir, overwrite=args.overwrite, extra_files=extra)
    except KeyboardInterrupt:
        print(f"convert_checkpoint: interrupted; {args.out_dir} left as it was", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(
            f"convert_checkpoint: error: writing {args.out_dir} failed: {one_line(e)}",
            file=sys.stderr,
        )
        note_leftovers(Path(args.out_dir))  # (a full disk: what fills it, perhaps)
        return 1
    note_leftovers(Path(args.out_dir))
    if "tokenizer.json" not in copied:
        print(
            f"convert_checkpoint: note: {args.hf_dir} has no tokenizer.json, so {args.out_dir} "
            "serves token-id prompts only (serve.py); copy one in to serve text",
            file=sys.stderr,
        )
    n = sum(x.size for x in params_to_flat(params).values())
    print(
        f"converted {args.hf_dir} -> {args.out_dir}: {cfg.num_layers} layers, {n:,} params "
        f"in {cfg.dtype}, {time.perf_counter() - start:.1f} s"
        + (f"; merged LoRA adapter {args.merge_lora}" if adapter is not None else "")
        + (f"; copied {', '.join(copied)}" if copied else "")
    )
    return 0


if __name__ == "__main__":
    import cli  # (scripts/, beside this file)

    cli.exit_with(main())
