"""The embedded demo model: a small Llama trained by `scripts/train_demo.py`.

It ships inside the package (`pagedjax/demo_model/`: config.json, model.safetensors,
tokenizer.json, README.md with how it was made), so the demo and the end-to-end tests
run with no download. It loads like any HF checkpoint::

    from pagedjax import demo, weights
    cfg, params = weights.load_hf_checkpoint(demo.demo_model_dir())
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def demo_model_dir() -> Path:
    """`DEMO_MODEL_DIR`, after checking that the demo model's files are there.

    Raises:
      FileNotFoundError: the directory or one of its required files is missing (an
        install without package data, or a checkout where it was never trained),
        naming what is missing and how to rebuild it.
    """
    missing = [name for name in _REQUIRED if not (DEMO_MODEL_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the demo model at {DEMO_MODEL_DIR} is missing {missing}; reinstall pagedjax "
            "with its package data, or rebuild it with `python scripts/train_demo.py` "
            '(needs `pip install -e ".[train]"`)'
        )
    return DEMO_MODEL_DIR
