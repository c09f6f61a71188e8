"""pagedjax: a paged KV cache for LLM inference in JAX.

The engine's names, as vLLM's package gives them (`from pagedjax import LLM,
SamplingParams`); each is imported from its module on first use, so `import pagedjax`
alone loads nothing heavy. The modules themselves (`pagedjax.decode`, `pagedjax.cache`,
`pagedjax.model`, ...) are the functional core; README.md, "Where things are", lists them.
"""

import importlib

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]

_HOMES = {
    "LLM": "pagedjax.engine",
    "BeamSearchParams": "pagedjax.beam_search",
    "CompletionOutput": "pagedjax.request",
    "LoRARequest": "pagedjax.lora",
    "RequestOutput": "pagedjax.request",
    "RequestOutputKind": "pagedjax.sampling_params",
    "SamplingParams": "pagedjax.sampling_params",
    "StructuredOutputsParams": "pagedjax.guided",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # (the next lookup does not come here)
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
