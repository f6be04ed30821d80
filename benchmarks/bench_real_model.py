"""A real pretrained model through Echo's hot paths: SmolLM2-135M-Instruct on ``--device``.

Measured in one run, on one machine (its load average is recorded before and after):

  learner step   ``Trainer.step`` on a batch of B sequences (P prompt + C completion tokens,
                 built by ``bench_learner.make_batch``), ``updates`` optimizer updates; the model,
                 Adam and the batch on the device, as ``learner.device`` puts them.
  generation     the worker's ``TransformersBackend.generate`` (sampling plus the behaviour
                 log-probs of every token) vs plain Hugging Face ``generate`` on the same model,
                 prompts (chat template), seed and sampling settings, timed in interleaved
                 pairs; tokens/s of each and the median over the pairs of ours / plain (the
                 cost of the scores Echo needs).
  snapshot       what a publication costs the learner: the full state to host memory
                 (``Parallel.full_state``: the device->host copy; nothing to copy on a CPU), the
                 bf16 payload (``params_to_payload``), the manifest (chunk hashes + signature).
  T_bcast        the snapshot's size moved by ``labs.broadcast_bench.run_one`` (real relay processes
                 on loopback, unshaped) to the quickstart's workers: chains as the quickstart
                 plans them (no rates declared) and one forced chain through every worker.

    .venv/bin/python benchmarks/bench_real_model.py [--device auto] [--json FILE]

The model folder is built on first use (``make smollm2``). Timings on a shared CPU are noisy:
compare the ratios, and read the load averages stored with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_learner import _loadavg, make_batch  # noqa: E402

from echo_rl.core.steprow import COL  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "real_model.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch", type=int, default=16, help="learner sequences per step")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--updates", type=int, default=2)
    p.add_argument("--gen-prompts", type=int, default=4, help="groups per generate call")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workers", type=int, default=4, help="relays for T_bcast (the quickstart's 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=OUT)
    return p.parse_args(argv)


def clock(fn: Any, sync: Any) -> tuple[float, Any]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def timed(fn: Any, reps: int, sync: Any) -> tuple[list[float], Any]:
    """Run ``fn`` once to warm up, then ``reps`` times; wall seconds of each timed run."""
    out = fn()
    times = []
    for _ in range(reps):
        t, out = clock(fn, sync)
        times.append(t)
    return times, out


def bench_learner(a: argparse.Namespace, cfg: Any, sync: Any) -> tuple[dict[str, Any], Any, Any]:
    from echo_rl.core.config import LearnerConfig
    from echo_rl.core.models import load_model, load_tokenizer
    from echo_rl.learner.parallel import make_parallel
    from echo_rl.learner.trainer import Trainer

    par = make_parallel(a.device)
    tok = load_tokenizer(cfg)
    cpu_model = load_model(cfg, tok)
    batch, _ = make_batch(
        argparse.Namespace(
            seed=a.seed,
            batch=a.batch,
            prompt_len=a.prompt_len,
            completion_len=a.completion_len,
            ragged=False,
        ),
        cpu_model,
        tok,
    )
    model = par.wrap(cpu_model)
    trainer = Trainer(model, LearnerConfig(lr=1e-6, updates_per_step=a.updates), parallel=par)
    times, _ = timed(lambda: trainer.step(par.to_device(batch)), a.reps, sync)
    tokens = int(batch.attention_mask.sum())
    res = {
        "device": str(par.device),
        "step_s": times,
        "step_s_median": statistics.median(times),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / statistics.median(times),
        "params": sum(p.numel() for p in model.parameters()),
        "param_dtype": str(next(model.parameters()).dtype),
    }
    return res, par, trainer


def bench_snapshot(
    a: argparse.Namespace, par: Any, trainer: Any, sync: Any
) -> tuple[dict[str, Any], int]:
    from echo_rl.broadcast.snapshot import RunKey, build_manifest
    from echo_rl.core.models import params_to_payload

    names = [n for n, _ in trainer.model.named_parameters()]
    sync()
    t0 = time.perf_counter()
    model_sd, _ = par.full_state(trainer.model, trainer.optimizer)  # device -> host
    t1 = time.perf_counter()
    tensors, payload = params_to_payload([(n, model_sd[n]) for n in names], "bfloat16")
    t2 = time.perf_counter()
    build_manifest(
        run_id="bench",
        version=1,
        tensors=tensors,
        payload=payload,
        chunk_size=1024 * 1024,
        dtype="bfloat16",
        key=RunKey.generate(),
    )
    t3 = time.perf_counter()
    return {
        "device_to_host_s": t1 - t0,
        "payload_bf16_s": t2 - t1,
        "manifest_s": t3 - t2,
        "total_s": t3 - t0,
        "payload_bytes": len(payload),
    }, len(payload)


def bench_generation(a: argparse.Namespace, cfg: Any, sync: Any) -> dict[str, Any]:
    import torch

    from echo_rl.adapters.math import MathAdapter
    from echo_rl.core import wire
    from echo_rl.worker.backends import make_backend

    backend = make_backend("transformers", model_cfg=cfg, threads=a.threads, device=a.device)
    adapter = MathAdapter(
        {"path": str(ROOT / "examples" / "data" / "arith_words.jsonl")}, backend.tokenizer
    )
    prompts = [ids for ids, _ in adapter.items()[: a.gen_prompts]]
    groups = [
        wire.Group(group_id=f"g{i}", prompt_ids=p, n=a.group_size, seed=a.seed)
        for i, p in enumerate(prompts)
    ]
    tok = backend.tokenizer

    def ours() -> int:
        out = backend.generate(groups, a.new_tokens, 1.0)
        return sum(len(s.completion_ids) for g in out for s in g)

    def plain() -> int:  # the same call without scores: what the sampling alone costs
        rows = [g.prompt_ids for g in groups for _ in range(g.n)]
        width = max(map(len, rows))
        ids = torch.tensor(
            [[tok.pad_token_id] * (width - len(r)) + r for r in rows], device=backend.device
        )
        attn = (
            torch.arange(width, device=backend.device)[None, :]
            >= torch.tensor([width - len(r) for r in rows], device=backend.device)[:, None]
        ).long()
        torch.manual_seed(a.seed)
        with torch.no_grad():
            seq = backend.model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=a.new_tokens,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        new = seq[:, width:].tolist()
        return sum(r.index(tok.eos_token_id) + 1 if tok.eos_token_id in r else len(r) for r in new)

    ours(), plain()  # warm-up
    # Interleaved pairs: the load of a shared machine drifts between the two sides alike.
    pairs = [(clock(ours, sync), clock(plain, sync)) for _ in range(a.reps)]
    t_ours, t_plain = [o[0] for o, _ in pairs], [p[0] for _, p in pairs]
    n_ours, n_plain = pairs[-1][0][1], pairs[-1][1][1]
    ratios = [(n_ours / o) / (n_plain / p) for o, p in zip(t_ours, t_plain)]
    return {
        "device": str(backend.device),
        "samples": len(groups) * a.group_size,
        "max_new_tokens": a.new_tokens,
        "ours_s": t_ours,
        "plain_s": t_plain,
        "ours_tokens": n_ours,
        "plain_tokens": n_plain,
        "ours_tokens_per_s": n_ours / statistics.median(t_ours),
        "plain_tokens_per_s": n_plain / statistics.median(t_plain),
        "ratio_ours_over_plain": statistics.median(ratios),
        "ratios": ratios,
    }


def bench_bcast(a: argparse.Namespace, payload_bytes: int) -> dict[str, Any]:
    from labs.broadcast_bench import run_one
    from labs.broadcast_root import BenchParams

    out = {}
    for name, chains in (("quickstart-chains", 0), ("one-chain", 1)):
        p = BenchParams(
            workers=a.workers,
            snapshot_mib=payload_bytes / 2**20,
            uplink_mbit=0,
            link_mbit=0,
            topology="chains",
            chunk_kib=1024,
            chains=chains,
            timeout_s=60.0,
            seed=a.seed,
        )
        r = asyncio.run(run_one(p))
        out[name] = {
            k: r[k]
            for k in (
                "t_bcast_s",
                COL.learner_bytes_sent,
                "snapshot_bytes",
                "installed",
                "corrupt_installs",
                "parents",
            )
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    import torch

    from echo_rl.core.config import ModelConfig
    from echo_rl.core.gguf_import import ensure_smollm2
    from echo_rl.core.machine import machine_info

    torch.set_num_threads(a.threads)
    if a.model == parse_args([]).model:
        ensure_smollm2(a.model, ROOT / "models" / ".cache")
    cfg = ModelConfig(name=str(a.model))
    sync = (
        torch.cuda.synchronize
        if torch.cuda.is_available() and a.device != "cpu"
        else (lambda: None)
    )
    load_before = _loadavg()
    learner, par, trainer = bench_learner(a, cfg, sync)
    print(
        f"learner step ({learner['device']}, {a.batch} x {a.prompt_len}+{a.completion_len} "
        f"tokens, {a.updates} updates): {learner['step_s_median']:.2f} s median"
    )
    snapshot, size = bench_snapshot(a, par, trainer, sync)
    print(
        f"snapshot: {size / 2**20:.1f} MiB bf16; device->host {snapshot['device_to_host_s']:.3f} s, "
        f"payload {snapshot['payload_bf16_s']:.2f} s, manifest {snapshot['manifest_s']:.2f} s"
    )
    del trainer, par
    gen = bench_generation(a, cfg, sync)
    print(
        f"generation: ours {gen['ours_tokens_per_s']:.1f} tok/s, plain generate "
        f"{gen['plain_tokens_per_s']:.1f} tok/s, ratio {gen['ratio_ours_over_plain']:.3f}"
    )
    bcast = bench_bcast(a, size)
    for name, r in bcast.items():
        print(
            f"T_bcast {name} ({a.workers} workers, loopback): {r['t_bcast_s']:.2f} s, "
            f"learner sent {r[COL.learner_bytes_sent] / 2**20:.0f} MiB"
        )
    result = {
        "benchmark": "real_model",
        "model": str(a.model.relative_to(ROOT) if a.model.is_relative_to(ROOT) else a.model),
        "machine": {
            **machine_info(),
            "torch_threads": a.threads,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "loadavg_1m_before": load_before,
            "loadavg_1m_after": _loadavg(),
        },
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "learner": learner,
        "snapshot": snapshot,
        "generation": gen,
        "broadcast": bcast,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.json}")
    return result


if __name__ == "__main__":
    main()
