"""What tests/test_generate_cli*.py share: scripts/generate.py loaded in-process (`gen`,
and `cli`, the scripts' shared module, as they import it; `load_script("chat")` loads
another script so), a runner of its `main(argv)` and a tiny checkpoint.

The checkpoint is a tiny random-weight HF directory written here (config.json,
model.safetensors, a byte-level tokenizer.json), served with the geometry of
tests/test_engine.py (`GEOMETRY`) so that they share compiled programs. `ckpt` is
module-scoped: a test module binds it (`ckpt = generate_cli_helpers.ckpt`) and gets its
own directory (writing one takes a few hundredths of a second once the first is written).
"""

import importlib.util
from pathlib import Path

import pytest
from params_helpers import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "generate.py"
GEOMETRY = ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]


def load_script(name: str = "generate"):
    """scripts/{name}.py as a module, loaded in-process."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = load_script()
cli = gen.cli  # the scripts' shared module, as they import it


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_ckpt")
    write_tiny_checkpoint(path)
    return path


def run(argv, capsys):
    rc = gen.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err
