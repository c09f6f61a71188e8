"""Paged attention kernels for JAX: Pallas GPU and TPU kernels plus XLA references.

Importable without `pagedjax`. The two entry points take one layer's page pools
`[K, P, S, D]` and pick a backend with `backend="auto" | "gpu" | "tpu" | "xla"`.
Page-table entries a sequence does not read (past its last page, wholly before its
sliding window) are padding and may hold any id, such as -1.
"""

from pallas_kernels.dispatch import (
    BACKENDS,
    paged_decode_attention,
    ragged_paged_attention,
    resolve_backend,
)

__all__ = ["BACKENDS", "paged_decode_attention", "ragged_paged_attention", "resolve_backend"]
