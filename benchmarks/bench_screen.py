"""What the delivery screen (echo_rl/control/screen.py, security.screen_nats) costs the training step:
the same step with the screen on and off, side by side, alternating, on one batch.

    python benchmarks/bench_screen.py [--rows 64] [--length 48] [--reps 10] [--model tiny|smollm2]
        [--json benchmarks/results/bench_screen.json]

The screen reads the step-start log-probs the step computes anyway and adds one elementwise
pass over [rows, tokens]; on the tiny model (the cheapest forward, so the largest share it can
take) and on SmolLM2 the ratio says whether that is visible next to the forward and backward.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from echo_rl.core.config import LearnerConfig, ModelConfig  # noqa: E402
from echo_rl.core.machine import write_result  # noqa: E402
from echo_rl.data.adapter import LearnerBatch  # noqa: E402


def batch(rows: int, length: int, vocab: int, seed: int = 0) -> LearnerBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, min(vocab, 24), (rows, length), generator=g)
    mask = torch.zeros(rows, length - 1)
    mask[:, length // 3 :] = 1
    return LearnerBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        behaviour_logprobs=-torch.rand(rows, length - 1, generator=g) * 3,
        advantages=torch.randn(rows, generator=g),
        rewards=torch.zeros(rows),
        versions=torch.zeros(rows, dtype=torch.long),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--length", type=int, default=48)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/bench_screen.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from echo_rl.core.models import load_model, load_tokenizer
    from echo_rl.learner.trainer import Trainer

    mc = (
        ModelConfig()
        if args.model == "tiny"
        else ModelConfig(name=str(ROOT / "models/smollm2-135m-instruct"))
    )
    tok = load_tokenizer(mc)
    torch.manual_seed(0)
    model = load_model(mc, tok, "float32")
    b = batch(args.rows, args.length, len(tok))
    cfg = LearnerConfig(lr=1e-5, updates_per_step=2)
    # Honest claims: the model's own log-probs of the batch's tokens (what a worker on the same
    # version sends), so the screen passes every row and only its pass over them is timed.
    with torch.no_grad():
        own = Trainer(model, cfg).logprobs(model, b, torch.arange(args.rows))
    b = dataclasses.replace(b, behaviour_logprobs=own.detach().clone())
    trainers = {
        "screen_off": Trainer(copy.deepcopy(model), cfg, seed=3, screen_nats=0.0),
        "screen_on": Trainer(copy.deepcopy(model), cfg, seed=3, screen_nats=4.0),
    }
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for t in trainers.values():
        t.step(b)  # warm-up
    for i in range(args.reps):
        for name in list(trainers) if i % 2 == 0 else list(trainers)[::-1]:
            t0 = time.perf_counter()
            trainers[name].step(b)
            times[name].append(time.perf_counter() - t0)
        print(
            f"rep {i + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items())
        )
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": args.model,
        "rows": args.rows,
        "length": args.length,
        "reps": args.reps,
        "threads": args.threads,
        "step_s_median": med,
        "ratio_on_over_off": round(med["screen_on"] / med["screen_off"], 4),
        "screened_rows": trainers["screen_on"].screened_rows,
    }
    print(
        f"step median: off {med['screen_off']:.4f} s, on {med['screen_on']:.4f} s, "
        f"ratio {result['ratio_on_over_off']}"
    )
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
