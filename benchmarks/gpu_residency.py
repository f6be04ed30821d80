"""``make gpu-check``'s ``residency`` stage: what a switch between runs costs a worker that has
fewer device slots than runs (``echo-worker join --resident K``, docs/multirun.md). A switch is
a park (the model it leaves, to host memory) and an unpark (the model of the run whose turn it
is, back to the GPU). Two ways, on the same model, one after the other:

  * ``pageable``: ``model.to("cpu")`` and ``model.to("cuda")``, what the worker did before
    ``echo_rl/worker/backends/parking.py``: fresh pageable host memory at every park;
  * ``pinned``: ``HostParking`` (what ``TransformersBackend.park``/``unpark`` run): host copies
    made once, page-locked, one direct copy a tensor. Its first park, which allocates and pins
    them, is timed apart.

Models, bf16 as a GPU worker generates: SmolLM2-135M through the worker's own backend (the real
weights when the model stage imported them), and random-init Qwen3 models of ~1.1B and ~3.1B
parameters (the simulator's multirun jobs are 3B models with ``warm_s = 2.5``). Each case checks
that a park frees the model's GPU memory and that a cycle leaves every tensor as it was.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def _checksum(model: Any) -> float:
    return float(sum(t.double().sum().item() for t in model.state_dict().values()))


def _cycles(
    park: Callable[[], None], unpark: Callable[[], None], reps: int, sync: Callable[[], None]
) -> tuple[list[float], list[float], int]:
    """Seconds of each park and unpark over ``reps`` cycles, and the GPU bytes a park freed."""
    import torch

    parks, unparks, freed = [], [], 0
    for _ in range(reps):
        sync()
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        t0 = time.perf_counter()
        park()
        sync()
        t1 = time.perf_counter()
        if torch.cuda.is_available():
            freed = before - torch.cuda.memory_allocated()
        unpark()
        sync()
        parks.append(t1 - t0)
        unparks.append(time.perf_counter() - t1)
    return parks, unparks, freed


def one_case(model: Any, device: str, reps: int, sync: Callable[[], None]) -> dict[str, Any]:
    import torch

    from echo_rl.worker.backends.parking import HostParking

    parking = HostParking.whole(model, torch.device(device))
    nbytes = parking.nbytes()
    gb = nbytes / 1e9
    before = _checksum(model)
    out: dict[str, Any] = {"gib": nbytes / 2**30, "params": sum(p.numel() for p in parking.params)}
    p_park, p_unpark, p_freed = _cycles(
        lambda: model.to("cpu"), lambda: model.to(device), reps, sync
    )
    t0 = time.perf_counter()
    parking.park()  # allocates and pins the host copies
    sync()
    first = time.perf_counter() - t0
    parking.unpark()
    sync()
    h_park, h_unpark, h_freed = _cycles(parking.park, parking.unpark, reps, sync)
    for way, parks, unparks, freed in (
        ("pageable", p_park, p_unpark, p_freed),
        ("pinned", h_park, h_unpark, h_freed),
    ):
        park_s, unpark_s = statistics.median(parks), statistics.median(unparks)
        out[way] = {
            "park_s": parks,
            "unpark_s": unparks,
            "switch_s_median": park_s + unpark_s,
            "park_gb_per_s": gb / park_s,
            "unpark_gb_per_s": gb / unpark_s,
            "gpu_bytes_freed_by_a_park": freed,
        }
    out["pinned"]["first_park_s"] = first
    out["speedup_switch"] = out["pageable"]["switch_s_median"] / out["pinned"]["switch_s_median"]
    out["unchanged_after_cycles"] = _checksum(model) == before
    return out


def stage_residency(a: argparse.Namespace, rec: Any) -> None:
    import torch

    from benchmarks.gpu_stages import QWEN3_1B, QWEN3_3B, TINY, _backend, _device, _sync, build

    device, sync = _device(a), _sync(_device(a))
    reps = 1 if a.dry_run else max(a.reps, 3)
    backend, cfg = _backend(a)
    cases: list[tuple[str, Callable[[], Any]]] = [("smollm2", lambda: backend.model)]
    if a.dry_run:
        cases = [("tiny", lambda: build(TINY, device))]
    else:
        cases += [
            ("qwen3_1b", lambda: build(QWEN3_1B, device).to(torch.bfloat16)),
            ("qwen3_3b", lambda: build(QWEN3_3B, device).to(torch.bfloat16)),
        ]
    rec.put("smollm2_model", cfg.name)
    for name, make in cases:
        model = make()
        res = one_case(model, device, reps, sync)
        rec.put(name, res)
        print(
            f"residency {name} ({res['gib']:.2f} GiB): switch (park + unpark) "
            f"pageable {res['pageable']['switch_s_median'] * 1e3:.0f} ms, "
            f"pinned {res['pinned']['switch_s_median'] * 1e3:.0f} ms "
            f"({res['speedup_switch']:.1f}x; first pinned park "
            f"{res['pinned']['first_park_s'] * 1e3:.0f} ms)",
            flush=True,
        )
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
