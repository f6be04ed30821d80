"""The learner's step-time memory: how far a training step rises above the training state, for
micro-batch sizes and gradient checkpointing (docs/memory.md "Step-time memory"; the constants
of echo_rl/core/memplan.py come from it).

    .venv/bin/python benchmarks/step_memory.py [--model random-0.4b] [--rows 4] [--tokens 140]
        # writes benchmarks/results/step_memory_<model>.json

Each setting runs in a fresh process: the model (float32) and a Trainer, then two steps on a
synthetic batch of ``--rows`` rows of ``--tokens`` tokens (the last 16 trained). A thread reads
the process's anonymous resident memory every 20 ms; after each step glibc's free memory goes
back to the kernel (as the learner does), and the step's rise is its peak minus the memory
before it (the second step: the optimizer state exists by then). Last, one forward of all the
rows with the graph kept measures the activations alone. The step's rise is not the sum of the
two: the step frees the previous gradients before its backward, and the activations are freed
as the new gradients are made.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 1 << 30
ONE_UPDATE = "learner.updates_per_step=1"  # the batch is one mini-batch: --rows rows
SETTINGS = {
    "whole": [ONE_UPDATE, "learner.micro_batch_rows=0"],
    "one_row": [ONE_UPDATE, "learner.micro_batch_rows=1"],
    "checkpointing": [
        ONE_UPDATE,
        "learner.micro_batch_rows=0",
        "learner.gradient_checkpointing=true",
    ],
}


def anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(model: str, rows: int, tokens: int, overrides: list[str]) -> dict[str, Any]:
    """In this process: two steps; the second's rise above the memory before it."""
    import torch

    from echo_rl.broadcast.memory import trim
    from echo_rl.core.config import load_config
    from echo_rl.core.models import enable_checkpointing, load_model, load_tokenizer
    from echo_rl.data.adapter import LearnerBatch
    from echo_rl.learner.trainer import Sampling, Trainer

    cfg = load_config(ROOT / "examples/smollm2-math.toml", [f"model.name={model}", *overrides])
    tok = load_tokenizer(cfg.model)
    net = load_model(cfg.model, tok, "float32")
    if cfg.learner.gradient_checkpointing:
        enable_checkpointing(net)
    sampling = Sampling(max_new_tokens=16, eos_token_id=tok.eos_token_id)
    trainer = Trainer(net, cfg.learner, sampling=sampling)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 20_000, (rows, tokens), generator=g)
    mask = torch.zeros(rows, tokens - 1)
    mask[:, tokens - 17 :] = 1
    batch = LearnerBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        behaviour_logprobs=-torch.rand(rows, tokens - 1, generator=g) * 3,
        advantages=torch.randn(rows, generator=g),
        rewards=torch.zeros(rows),
        versions=torch.zeros(rows, dtype=torch.long),
    )
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    out: dict[str, Any] = {}
    for step in range(2):
        trim()
        before = peak[0] = anon()
        t0 = time.perf_counter()
        trainer.step(batch)
        out = {
            "before_bytes": before,
            "peak_bytes": peak[0],
            "rise_bytes": peak[0] - before,
            "step_s": round(time.perf_counter() - t0, 1),
        }
        print(
            f"  step {step}: {before / GIB:.2f} -> peak {peak[0] / GIB:.2f} GiB "
            f"({out['step_s']} s)",
            file=sys.stderr,
            flush=True,
        )
    # The activations alone: one forward of all the rows with the graph kept for backward, as
    # the first pass of a step holds them (its memory before backward frees them)
    trim()
    before = anon()
    net.train()
    logits = net(input_ids=ids, attention_mask=batch.attention_mask, logits_to_keep=17).logits
    out["activations_bytes"] = anon() - before
    del logits
    stop.set()
    mc = net.config
    out.update(
        params=sum(p.numel() for p in net.parameters()),
        layers=mc.num_hidden_layers,
        hidden=mc.hidden_size,
        rows=rows,
        tokens=tokens,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random-0.4b")
    ap.add_argument("--rows", type=int, default=4, help="rows of the batch: one mini-batch")
    ap.add_argument("--tokens", type=int, default=140)
    ap.add_argument(
        "--json",
        type=Path,
        default=None,
        help="default: benchmarks/results/step_memory_<model folder name>.json",
    )
    ap.add_argument("--one", nargs="*", help=argparse.SUPPRESS)  # a child: one setting
    args = ap.parse_args(argv)
    model = args.model
    if model.startswith("random-"):
        from benchmarks.memory import random_model

        model = str(random_model(model))
    if args.one is not None:
        print(json.dumps(measure(model, args.rows, args.tokens, args.one)))
        return 0
    from echo_rl.core.machine import write_result

    args.json = args.json or ROOT / "benchmarks/results" / f"step_memory_{Path(model).name}.json"

    results = {}
    for name, sets in SETTINGS.items():
        print(f"{name}: {' '.join(sets)}", flush=True)
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--model",
                model,
                "--rows",
                str(args.rows),
                "--tokens",
                str(args.tokens),
                "--one",
                *sets,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        )
        sys.stderr.write(child.stderr[-600:] if child.returncode else "")
        if child.returncode:
            return child.returncode
        results[name] = json.loads(child.stdout.strip().splitlines()[-1])
    whole = results["whole"]
    units = args.rows * args.tokens * whole["hidden"]
    for r in results.values():
        r["rise_gib"] = round(r["rise_bytes"] / GIB, 2)
    # per (token x hidden unit): the activations of every layer kept, or with checkpointing
    # each layer's input (and the recomputed layer's, in backward)
    fit = {
        "act_bytes_per_token_layer_unit": round(
            whole["activations_bytes"] / (units * whole["layers"]), 1
        ),
        "checkpointed_bytes_per_token_unit": round(
            results["checkpointing"]["activations_bytes"] / units, 1
        ),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(
        args.json, {"argv": sys.argv[1:], "settings": SETTINGS, "results": results, "fit": fit}
    )
    for name, r in results.items():
        print(
            f"{name:>14}: step rises {r['rise_gib']:.2f} GiB above {r['before_bytes'] / GIB:.2f} GiB "
            f"({r['step_s']} s a step); a forward of all {args.rows} rows keeps "
            f"{r['activations_bytes'] / GIB:.2f} GiB for backward"
        )
    print(
        f"activations: {fit['act_bytes_per_token_layer_unit']} bytes per token x layer x hidden "
        f"unit; {fit['checkpointed_bytes_per_token_unit']} per token x hidden unit checkpointed"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
