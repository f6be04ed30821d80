"""Generation speed: today's transformers backend and Echo's engine side by side.

Both backends hold the same model (the engine's weights are copied from the other's), get
the same groups (GRPO-shaped: n = 8 samples a prompt, fewer at batch 1) with the same seeds,
and are timed alternately, the order swapped every repetition, so a shared machine's drift
falls on both. Per model and batch it prints and stores:

  tokens/s     new tokens of a request / its wall time (median over repetitions)
  prefill      a request for one new token (its prompt reading, the first sample)
  decode       (tokens - rows) / (request - prefill): tokens/s of the steps after the first
  ratio        engine / transformers, the median of the per-repetition ratios
  memory       CUDA: peak allocated during the request; CPU: the engine's key/value cache
               and the scores tensor ``generate`` keeps ([rows, tokens, vocab] float32)

By default every row runs to ``--new-tokens`` (end-of-sequence is left out of the sampled
set, as ``restrict_answers`` does for both), so tokens/s is the batch's, not its longest
row's; ``--eos`` keeps the end-of-sequence token and counts what was sampled.

    .venv/bin/python benchmarks/gen_speed.py --model tiny --batches 1,16,64
    .venv/bin/python benchmarks/gen_speed.py --model smollm2 --new-tokens 32
    python3 benchmarks/gen_speed.py --model smollm2 --device cuda --batches 1,16,64,256

Results go to ``benchmarks/results/gen_speed[_<model>].json`` (``--json`` to choose).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
BACKENDS = ("transformers", "engine")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | smollm2 | a model folder")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a worker's default)")
    p.add_argument("--batches", default="1,16,64", help="rows per request, comma-separated")
    p.add_argument(
        "--new-tokens",
        type=int,
        default=0,
        help="per row (0: 48 on the tiny model's 64 positions, else 128)",
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--eos", action="store_true", help="rows may end at end-of-sequence")
    p.add_argument(
        "--compile", action="store_true", help="CUDA: torch.compile the engine's step too"
    )
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def model_config(name: str) -> Any:
    from echo_rl.core.config import ModelConfig

    if name == "tiny":
        return ModelConfig()
    path = SMOLLM2 if name == "smollm2" else Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"no model folder at {path}: run `make smollm2` first")
    return ModelConfig(name=str(path))


def prompts(backend: Any, cfg: Any, n: int) -> list[list[int]]:
    if cfg.name == "tiny-qwen3":
        return [[5 + i % 10, 6, 7 + i % 3, 8, 9, 10] for i in range(n)]
    from echo_rl.adapters.math import MathAdapter

    data = ROOT / "examples" / "data" / "arith_words.jsonl"
    items = MathAdapter({"path": str(data)}, backend.tokenizer).items()
    return [items[i % len(items)][0] for i in range(n)]


def groups_for(backend: Any, cfg: Any, rows: int) -> list[Any]:
    from echo_rl.core import wire

    n = min(rows, 8)
    count = max(1, rows // n)
    return [
        wire.Group(group_id=f"g{i}", prompt_ids=p, n=n, seed=1000 + i)
        for i, p in enumerate(prompts(backend, cfg, count))
    ]


def build(cfg: Any, device: str, threads: int, compile: bool = False) -> dict[str, Any]:
    from echo_rl.worker.backends import make_backend
    from echo_rl.worker.backends.engine import EngineTuning

    out = {
        "transformers": make_backend("transformers", model_cfg=cfg, threads=threads, device=device),
        "engine": make_backend(
            "engine",
            model_cfg=cfg,
            threads=threads,
            device=device,
            tuning=EngineTuning(compile=compile),
        ),
    }
    out["engine"].model.load_state_dict(out["transformers"].model.state_dict())
    return out


def request(backend: Any, groups: list[Any], new_tokens: int, sync: Any) -> tuple[float, int]:
    sync()
    t0 = time.perf_counter()
    out = backend.generate(groups, new_tokens, 1.0)
    sync()
    return time.perf_counter() - t0, sum(len(s.completion_ids) for g in out for s in g)


def measure(a: argparse.Namespace, backends: dict[str, Any], cfg: Any, rows: int) -> dict[str, Any]:
    import torch

    cuda = next(iter(backends.values())).device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    groups = groups_for(backends["transformers"], cfg, rows)
    rows = sum(g.n for g in groups)
    for b in backends.values():  # warm-up: kernels, allocator, the engine's captured step
        request(b, groups, a.new_tokens, sync)
        request(b, groups, 1, sync)
    runs: dict[str, dict[str, list[float]]] = {
        n: {"full": [], "prefill": [], "tokens": [], "peak": []} for n in backends
    }
    for rep in range(a.reps):
        order = list(BACKENDS) if rep % 2 == 0 else list(reversed(BACKENDS))
        for name in order:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            full, tokens = request(backends[name], groups, a.new_tokens, sync)
            peak = torch.cuda.max_memory_allocated() if cuda else 0
            prefill, _ = request(backends[name], groups, 1, sync)
            r = runs[name]
            r["full"].append(full)
            r["prefill"].append(prefill)
            r["tokens"].append(tokens)
            r["peak"].append(peak)
    out: dict[str, Any] = {"rows": rows, "groups": len(groups), "new_tokens": a.new_tokens}
    vocab = backends["transformers"].vocab_size
    for name, r in runs.items():
        tokens = statistics.median(r["tokens"])
        full, prefill = statistics.median(r["full"]), statistics.median(r["prefill"])
        out[name] = {
            "seconds": r["full"],
            "prefill_seconds": r["prefill"],
            "tokens": tokens,
            "tokens_per_s": tokens / full,
            "prefill_ms": prefill * 1e3,
            "decode_tokens_per_s": (tokens - rows) / max(full - prefill, 1e-9),
            "peak_cuda_mib": max(r["peak"]) / 2**20 if cuda else None,
        }
    out["transformers"]["scores_mib"] = rows * a.new_tokens * vocab * 4 / 2**20
    eng = backends["engine"]
    if eng.decoder is not None:
        d = eng.decoder
        columns = max(len(g.prompt_ids) for g in groups) + a.new_tokens
        per = 2 * len(d.layers) * d.kv_heads * d.head_dim * columns
        out["engine"]["kv_cache_mib"] = (
            min(rows, eng.slots) * per * 2 ** (1 if d.dtype != torch.float32 else 2) / 2**20
        )
    ratios = [
        t / e for t, e in zip(runs["transformers"]["full"], runs["engine"]["full"], strict=True)
    ]
    out["ratio"] = statistics.median(ratios)
    out["ratios"] = ratios
    return out


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "loadavg": os.getloadavg(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# Memory bandwidth of the cards Echo's GPU checks run on (bytes/s): a decode step reads every
# weight once, so rows / (weight bytes / bandwidth) bounds tokens/s from above at any batch
# (the KV cache and launch floor lower it further: ../docs/gpu.md).
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def bound(backend: Any, rows: int) -> float | None:
    import torch

    if backend.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    bw = next((v for k, v in BANDWIDTH.items() if k in name), None)
    if bw is None:
        return None
    weights = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    return rows * bw / weights


def run(a: argparse.Namespace, emit: Any = None) -> dict[str, Any]:
    """Every batch of ``a.batches``, both backends; ``emit(result)`` after each batch (a
    caller under a time budget keeps what was measured)."""
    import transformers

    cfg = model_config(a.model)
    a.new_tokens = a.new_tokens or (48 if cfg.name == "tiny-qwen3" else 128)
    backends = build(cfg, a.device, a.threads, a.compile)
    eng = backends["engine"]
    if not a.eos:
        eos = backends["transformers"].tokenizer.eos_token_id
        every = tuple(t for t in range(eng.vocab_size) if t != eos)
        for b in backends.values():
            b.restrict_answers(every)
    result: dict[str, Any] = {
        "benchmark": "gen_speed",
        "command": f"benchmarks/gen_speed.py --model {a.model} --device {a.device} "
        f"--threads {a.threads} --batches {a.batches} --new-tokens {a.new_tokens} "
        f"--reps {a.reps}" + (" --eos" if a.eos else "") + (" --compile" if a.compile else ""),
        "model": cfg.name,
        "device": str(eng.device),
        "dtype": str(eng.decoder.dtype if eng.decoder else "n/a"),
        "threads": a.threads,
        "eos": a.eos,
        "engine": {
            "runs_own_loop": eng.decoder is not None,
            "cuda_graph": eng.graphs,
            "compile": eng.compile,
            "slots": eng.slots,
        },
        "transformers_version": transformers.__version__,
        "machine": machine(),
        "batches": {},
    }
    print(
        f"{'batch':>5}  {'transformers tok/s':>18}  {'engine tok/s':>12}  {'ratio':>6}  "
        f"{'prefill ms (t/e)':>17}  {'decode tok/s (t/e)':>19}  {'weights bound':>13}",
        flush=True,
    )
    for rows in (int(x) for x in a.batches.split(",")):
        m = measure(a, backends, cfg, rows)
        m["weights_bound_tokens_per_s"] = bound(eng, m["rows"])
        result["batches"][str(rows)] = m
        result["engine"]["cuda_graph"] = eng.graphs  # False once a capture failed
        result["engine"]["compile"] = eng.compile
        t, e = m["transformers"], m["engine"]
        b = m["weights_bound_tokens_per_s"]
        print(
            f"{m['rows']:>5}  {t['tokens_per_s']:>18.0f}  {e['tokens_per_s']:>12.0f}  "
            f"{m['ratio']:>5.2f}x  {t['prefill_ms']:>8.1f}/{e['prefill_ms']:<8.1f}  "
            f"{t['decode_tokens_per_s']:>9.0f}/{e['decode_tokens_per_s']:<9.0f}  "
            f"{'n/a' if b is None else f'{b:.0f}':>13}",
            flush=True,
        )
        if emit is not None:
            emit(result)
    result["machine"]["loadavg_after"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    result = run(a)
    tag = "tiny" if result["model"] == "tiny-qwen3" else Path(result["model"]).name
    path = a.json or ROOT / "benchmarks" / "results" / f"gen_speed_{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {path}", flush=True)
    return result


if __name__ == "__main__":
    main()
