"""The engine-side half of a refit: a vLLM worker extension.

vLLM mixes this class into its GPU worker (``LLM(worker_extension_cls=...)``), in the engine's
own process, and ``LLM.collective_rpc("echo_refit", args=...)`` calls the method there. It must
stay importable without the rest of Echo (only torch): the engine process imports it by name.

The arguments are primitives (a path and tuples of names, dtypes, shapes and offsets), because
vLLM serialises RPC arguments with msgpack and refuses CUDA tensors; the bytes travel through
the shared-memory file the backend wrote (``echo_rl/worker/backends/refit.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    import torch


class RefitReport(TypedDict):
    """What one engine worker says of a refit: parameters loaded (-1: the model's
    ``load_weights`` reports nothing), and the first of those the snapshot did not reach."""

    loaded: int
    untouched: list[str]
    n_untouched: int


def iter_tensors(
    path: str,
    entries: list[tuple[str, str, list[int], int, int]],
    nbytes: int,
    device: str | torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on ``device``) for each entry of the shared file, in file order."""
    import torch

    raw = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    for name, dtype, shape, offset, n in entries:
        t = raw[offset : offset + n].view(getattr(torch, dtype)).view(tuple(shape))
        yield name, t.to(device, non_blocking=False)


class EchoRefitExtension:
    """Methods vLLM adds to each of its GPU workers (``self`` is that worker)."""

    def echo_refit(
        self, path: str, entries: list[tuple[str, str, list[int], int, int]], nbytes: int
    ) -> RefitReport:
        """Load every tensor of the shared file into the running model.

        Returns how many engine parameters were loaded and which were not: vLLM fuses q/k/v and
        gate/up, so the names it reports are its own; a parameter the snapshot did not reach
        would keep old weights, and the backend refuses the install then.
        """
        import torch

        model = self.model_runner.model  # type: ignore[attr-defined]
        model = getattr(model, "runnable", model)  # a CUDA-graph wrapper keeps the model here
        with torch.no_grad():
            loaded = model.load_weights(weights=iter_tensors(path, entries, nbytes, self.device))  # type: ignore[attr-defined]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return untouched_report(model, loaded)


def untouched_report(model: torch.nn.Module, loaded: Collection[str] | None) -> RefitReport:
    params = {name for name, _ in model.named_parameters()}
    if loaded is None:  # a model class whose load_weights reports nothing: nothing to compare
        return {"loaded": -1, "untouched": [], "n_untouched": 0}
    untouched = sorted(params - set(loaded))
    return {
        "loaded": len(set(loaded) & params),
        "untouched": untouched[:8],
        "n_untouched": len(untouched),
    }
