"""Delta snapshots on real weights: how much of SmolLM2-135M-Instruct changes per RL-sized step.

For each learning rate, from the pretrained weights: ``--steps`` real Adam steps (float32
weights, an SFT loss on a small fixed batch), and after each the bf16 payload the learner
publishes (``params_to_payload``), built into a publication by the learner's own
``VersionEncoder`` against the previous step (every step after the first a delta). Per step:
the changed-element fraction, delta bytes / full bytes for each encoding alone (full, xor_lz4,
sparse) and for the per-tensor choice, encode throughput, decode throughput (``decode`` alone,
and ``rebuild`` = decode plus the check of every rebuilt chunk against the signed hashes), all in
MB/s of model size, and whether the rebuilt bytes hash equal to the learner's.

    .venv/bin/python benchmarks/delta_real.py [--lrs 1e-6 1e-5] [--steps 8] [--record DIR]

``--record DIR`` keeps the full payloads of the ``--record-lr`` run (``DIR/layout.json``,
``DIR/v000.bin`` = the pretrained weights, then one per step) for
``python -m labs.broadcast_bench --versions-dir DIR``. Results: ``benchmarks/results/delta/``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXTS = [
    "The learner publishes a new version of the policy after every step.",
    "Workers on home connections relay each chunk to the next worker in the chain.",
    "A delta carries only the weights whose bf16 value changed since the last version.",
    "Every rebuilt payload is checked against the hashes the learner signed.",
]
STEADY_FROM = 3  # steps 1-2: Adam's moments are still warming up


def load(model: str, threads: int) -> tuple[Any, Any]:
    """The model (float32, as the learner trains it) and its tokenizer; a clear error if the
    folder is missing."""
    import torch

    from echo_rl.core.config import ModelConfig
    from echo_rl.core.models import ModelError, load_model, load_tokenizer

    torch.set_num_threads(threads)
    cfg = ModelConfig(name=model)
    try:
        tok = load_tokenizer(cfg)
        return load_model(cfg, tok, "float32"), tok
    except ModelError as err:
        raise SystemExit(
            f"{err}\nfix: `make smollm2` (echo-rl model smollm2) builds {model}"
        ) from None


def sft_batch(tok: Any) -> Any:
    return tok(TEXTS, return_tensors="pt", padding=True).input_ids


def train_step(model: Any, opt: Any, batch: Any) -> None:
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(prev: bytes, pub: Any, full: bytes) -> dict[str, Any]:
    """One delta against the payload it was built from."""
    import blake3

    from echo_rl.broadcast.delta import decode
    from echo_rl.broadcast.versions import rebuild

    m, st, mb = pub.manifest, pub.stats, len(full) / 1e6
    t0 = time.perf_counter()
    decoded = decode(m.tensors, pub.payload, prev, m.result_size)
    t_dec = time.perf_counter() - t0
    t0 = time.perf_counter()
    rebuilt = rebuild(m, pub.payload, prev)
    t_reb = time.perf_counter() - t0
    same = (
        blake3.blake3(bytes(rebuilt)).digest()
        == blake3.blake3(full).digest()
        == blake3.blake3(bytes(decoded)).digest()
    )
    return {
        "encoding": m.encoding,
        "changed_fraction": st.changed_fraction,
        "ratio_chosen": len(pub.payload) / len(full),
        "ratio_by_encoding": {k: v / len(full) for k, v in st.sizes.items()},
        "tensors_by_encoding": dict(st.chosen),
        "delta_bytes": len(pub.payload),
        "full_bytes": len(full),
        "encode_mb_s": mb / st.encode_s,
        "build_mb_s": mb / pub.build_s,
        "decode_mb_s": mb / t_dec,
        "rebuild_mb_s": mb / t_reb,
        "bit_exact": same,
    }


def run_lr(
    base_model: Any, batch: Any, lr: float, steps: int, record: Path | None, progress: Any
) -> list[dict[str, Any]]:
    import torch

    from echo_rl.broadcast.snapshot import RunKey
    from echo_rl.broadcast.versions import VersionEncoder
    from echo_rl.core.models import params_to_payload

    model = copy.deepcopy(base_model)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    enc = VersionEncoder(
        run_id="delta-real",
        key=RunKey.generate(),
        chunk_size=1 << 20,
        dtype="bfloat16",
        keyframe_every=10**9,
        max_ratio=1.0,
    )
    tensors, prev = params_to_payload(model.named_parameters(), "bfloat16")
    enc.build(0, tensors, prev)
    if record is not None:
        record.mkdir(parents=True, exist_ok=True)
        (record / "layout.json").write_text(json.dumps(tensors))
        (record / "v000.bin").write_bytes(prev)
    rows, task = [], progress.add_task(f"lr {lr:g}", total=steps)
    for step in range(1, steps + 1):
        train_step(model, opt, batch)
        _, full = params_to_payload(model.named_parameters(), "bfloat16")
        pub = enc.build(step, tensors, full)
        rows.append({"step": step, **measure(prev, pub, full)})
        if record is not None:
            (record / f"v{step:03d}.bin").write_bytes(full)
        prev = full
        progress.advance(task)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steady = [r for r in rows if r["step"] >= STEADY_FROM] or rows
    ratios = [r["ratio_chosen"] for r in steady]
    return {
        "steady_steps": [r["step"] for r in steady],
        "ratio_mean": statistics.mean(ratios),
        "ratio_max": max(ratios),
        "changed_fraction_mean": statistics.mean(r["changed_fraction"] for r in steady),
        "encode_mb_s_median": statistics.median(r["encode_mb_s"] for r in rows),
        "decode_mb_s_median": statistics.median(r["decode_mb_s"] for r in rows),
        "rebuild_mb_s_median": statistics.median(r["rebuild_mb_s"] for r in rows),
        "all_bit_exact": all(r["bit_exact"] for r in rows),
    }


def table(lr: float, rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title=f"SmolLM2-135M, Adam lr {lr:g}: bytes of each step's delta / full bf16")
    for col in (
        "step",
        "changed",
        "chosen",
        "xor_lz4",
        "sparse",
        "encode MB/s",
        "decode MB/s",
        "rebuild MB/s",
        "bit-exact",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        by = r["ratio_by_encoding"]
        t.add_row(
            str(r["step"]),
            f"{100 * r['changed_fraction']:.2f}%",
            f"{100 * r['ratio_chosen']:.2f}%",
            f"{100 * by['xor_lz4']:.2f}%",
            f"{100 * by['sparse']:.2f}%",
            f"{r['encode_mb_s']:.0f}",
            f"{r['decode_mb_s']:.0f}",
            f"{r['rebuild_mb_s']:.0f}",
            str(r["bit_exact"]),
        )
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", type=Path, help="keep the full payloads of one lr here")
    ap.add_argument("--record-lr", type=float, default=1e-6)
    ap.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "delta" / "real_smollm2.json"
    )
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.progress import Progress

    from echo_rl.core.machine import write_result

    model, tok = load(args.model, args.threads)
    batch = sft_batch(tok)
    load_before = os.getloadavg()
    runs = {}
    with Progress() as progress:
        for lr in args.lrs:
            rec = args.record if args.record is not None and lr == args.record_lr else None
            runs[f"{lr:g}"] = run_lr(model, batch, lr, args.steps, rec, progress)
    out = {
        "command": " ".join(sys.argv),
        "model": args.model,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "steps": args.steps,
        "steady_from_step": STEADY_FROM,
        "runs": {lr: {"summary": summarize(rows), "rows": rows} for lr, rows in runs.items()},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, out)
    console = Console()
    for lr, rows in runs.items():
        console.print(table(float(lr), rows))
        s = out["runs"][lr]["summary"]
        console.print(
            f"lr {lr}: steady state (steps >= {STEADY_FROM}) delta = "
            f"{100 * s['ratio_mean']:.2f}% of full (max {100 * s['ratio_max']:.2f}%); "
            f"decode {s['decode_mb_s_median']:.0f} MB/s, rebuild "
            f"{s['rebuild_mb_s_median']:.0f} MB/s; bit-exact: {s['all_bit_exact']}"
        )
    console.print(f"load {load_before[0]:.1f} -> {out['loadavg_after'][0]:.1f}; {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
