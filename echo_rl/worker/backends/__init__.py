"""Generation backends, picked by ``worker.backend``: a base class plus one file each.

Implementations are imported only when chosen (they pull in torch or vLLM).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from echo_rl.worker.backends.base import Backend, Sample

BACKENDS = {
    "engine": "echo_rl.worker.backends.engine:EngineBackend",
    "transformers": "echo_rl.worker.backends.transformers:TransformersBackend",
    "vllm": "echo_rl.worker.backends.vllm:VLLMBackend",
}


_warming: list[Any] = []  # the warm-up thread, if one was started


def make_backend(name: str, **kwargs: Any) -> Backend:
    for thread in _warming:  # no import of these libraries beside the warm-up's: transformers'
        thread.join()  # lazy module is not safe to import from two threads at once
    if name not in BACKENDS:
        raise ValueError(f"unknown worker.backend {name!r}: choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    backend: Backend = getattr(import_module(module), cls)(**kwargs)
    return backend


# What the transformers backend's model load imports: seconds of a worker's first install.
WARM = ("echo_rl.worker.backends.transformers", "transformers.modeling_utils")


def warm(name: str | None) -> None:
    """Import the transformers backend's libraries on a daemon thread now, while the worker
    joins and waits for the learner: the model load after the join then finds them loaded
    (about 3 s of a CPU's time, issue 30). vLLM is left to its own load (its import sets up
    process-wide state that belongs on the thread that uses it). ``make_backend`` waits for it:
    nothing else in a worker imports them."""
    import threading

    if name not in (None, "engine", "transformers"):
        return

    def imports() -> None:
        for module in WARM:
            try:
                import_module(module)
            except Exception:  # noqa: BLE001 - the load imports it again and reports it
                return

    thread = threading.Thread(target=imports, name="echo-warm", daemon=True)
    _warming.append(thread)
    thread.start()


__all__ = ["BACKENDS", "Backend", "Sample", "make_backend", "warm"]
