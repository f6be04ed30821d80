"""The LM head and the sampled tokens' log-probs, plain against fused (echo_rl/learner/head.py):
time and memory of one forward and backward, on the device at hand.

    .venv/bin/python benchmarks/bench_head.py [--tokens 1024] [--hidden 576] \
        [--vocab 49152 151936] [--json benchmarks/results/head_<device>.json]

Plain: ``hidden @ W.T`` (the model's LM head), then ``selective_logprobs`` (the float32
log-sum-exp a row at a time), as ``token_logprobs`` runs with ``learner.fused_head = false``.
Fused: ``head_logprobs``, the head and the log-softmax a chunk of positions at a time. Each
variant runs in its own process (``--one``), with the same inputs: memory is the process's peak
(CPU: ``ru_maxrss``, resident; GPU: ``torch.cuda.max_memory_allocated``); time is the median
of ``--reps`` after a warm-up. The sizes default
to SmolLM2-135M's head (576 x 49,152) and the same width at Qwen's 151,936-token vocabulary,
1,024 trained positions (a micro-batch of 8 rows of 128 completion tokens).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def one(
    variant: str, tokens: int, hidden: int, vocab: int, reps: int, dtype: str
) -> dict[str, Any]:
    import torch

    from echo_rl.learner.head import head_logprobs
    from echo_rl.learner.trainer import selective_logprobs

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(1, tokens, hidden, generator=g).to(dev, dt).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(dev, dt).requires_grad_()
    t = torch.randint(0, vocab, (1, tokens), generator=g).to(dev)

    def run() -> None:
        if variant == "fused":
            lp = head_logprobs(h, w, t)
        else:
            lp = selective_logprobs(h @ w.t(), t)
        lp.sum().backward()
        if dev == "cuda":
            torch.cuda.synchronize()

    run()  # warm-up; the gradients now exist, as in a step
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    peak = (
        torch.cuda.max_memory_allocated()
        if dev == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "variant": variant,
        "device": dev,
        "dtype": dtype,
        "vocab": vocab,
        "time_s": times,
        "time_s_median": statistics.median(times),
        # the process's peak (CPU: resident; GPU: allocated), the same inputs on both sides
        "peak_mib": peak / 2**20,
        "base_mib": base / 2**20,
        "logits_f32_mib": tokens * vocab * 4 / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--dtype", default="", help="float32 on a CPU, bfloat16 on a GPU (default)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # a child: one variant
    a = ap.parse_args(argv)
    if a.one:
        vocab = a.vocab[0]
        print(json.dumps(one(a.one, a.tokens, a.hidden, vocab, a.reps, a.dtype)))
        return 0
    import torch

    from echo_rl.core.machine import machine_info

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = a.dtype or ("bfloat16" if dev == "cuda" else "float32")
    rows = []
    print(f"{'vocab':>8} {'variant':>7} {'median s':>9} {'peak MiB':>9} {'logits f32 MiB':>15}")
    for vocab in a.vocab:
        for variant in ("plain", "fused"):
            args = [*("--tokens", str(a.tokens), "--hidden", str(a.hidden)), "--vocab", str(vocab)]
            args += ["--reps", str(a.reps), "--dtype", dtype, "--one", variant]
            out = subprocess.run(
                [sys.executable, __file__, *args], check=True, capture_output=True, text=True
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            rows.append(r)
            print(
                f"{vocab:8d} {variant:>7} {r['time_s_median']:9.3f} {r['peak_mib']:9.0f} "
                f"{r['logits_f32_mib']:15.0f}",
                flush=True,
            )
    summary = {}
    for vocab in a.vocab:
        plain, fused = (
            next(r for r in rows if r["vocab"] == vocab and r["variant"] == v)
            for v in ("plain", "fused")
        )
        summary[str(vocab)] = {
            "time_fused_over_plain": fused["time_s_median"] / plain["time_s_median"],
            "peak_mib_plain": plain["peak_mib"],
            "peak_mib_fused": fused["peak_mib"],
        }
    doc = {
        "benchmark": "head",
        "params": {"tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab, "dtype": dtype},
        "rows": rows,
        "summary": summary,
        "machine": machine_info(),
    }
    path = Path(a.json or ROOT / "benchmarks" / "results" / f"head_{dev}.json")
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
