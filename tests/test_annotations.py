"""The public API's annotations resolve: `typing.get_type_hints` works on them.

Tools that read a signature's types (dataclass serializers, pydantic, typer, IDEs'
runtime helpers) call `get_type_hints`; a name imported only under TYPE_CHECKING makes
it raise NameError. `LLM.generate`'s `on_step: Callable[[LLM], None]` and
`RequestOutput.lora_request` did.
"""

import inspect
import typing

import pytest

from pagedjax import beam_search, decode, engine, lora, request, static_batch

PUBLIC = [
    engine.LLM,
    request.SamplingParams,
    request.RequestOutput,
    request.CompletionOutput,
    lora.LoRARequest,
    beam_search.BeamSearchParams,
    beam_search.BeamSearchOutput,
    decode,
    static_batch,  # (decode.generate's home)
]


def public_callables(obj):
    if inspect.ismodule(obj):
        names = getattr(obj, "__all__", [n for n in vars(obj) if not n.startswith("_")])
        for name in names:
            value = getattr(obj, name)
            if inspect.isfunction(value) and value.__module__ == obj.__name__:
                yield f"{obj.__name__}.{name}", value
        return
    yield obj.__qualname__, obj
    for name, value in inspect.getmembers(obj):
        if (not name.startswith("_") or name == "__init__") and inspect.isfunction(value):
            yield f"{obj.__qualname__}.{name}", value


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda o: getattr(o, "__qualname__", o.__name__))
def test_type_hints_resolve(obj):
    checked = 0
    for name, value in public_callables(obj):
        try:
            typing.get_type_hints(value)
        except NameError as e:
            pytest.fail(f"typing.get_type_hints({name}): {e}")
        checked += 1
    assert checked > 0


def test_the_package_gives_the_engines_names_lazily():
    """`from pagedjax import LLM, SamplingParams`, as from vllm; `import pagedjax` alone
    imports no engine module (nor jax)."""
    import subprocess
    import sys

    code = (
        "import sys, pagedjax; "
        "assert 'jax' not in sys.modules and 'pagedjax.engine' not in sys.modules; "
        "from pagedjax import *; "
        "from pagedjax.engine import LLM as E; from pagedjax.request import SamplingParams as S; "
        "assert LLM is E and SamplingParams is S; "
        "import pagedjax as p; assert set(p.__all__) <= set(dir(p)); "
        "print(len(p.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8"
    import pagedjax

    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        pagedjax.Engine  # noqa: B018
