"""Generation backends, picked by ``worker.backend``: a base class plus one file each.

Implementations are imported only when chosen (they pull in torch or vLLM).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from worker.backends.base import Backend, Sample

BACKENDS = {"transformers": "worker.backends.transformers:TransformersBackend",
            "vllm": "worker.backends.vllm:VLLMBackend"}


def make_backend(name: str, **kwargs: Any) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown worker.backend {name!r}: choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(import_module(module), cls)(**kwargs)


__all__ = ["BACKENDS", "Backend", "Sample", "make_backend"]
