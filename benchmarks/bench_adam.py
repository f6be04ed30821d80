"""The learner's optimizer: Adam's fused kernels against PyTorch's default (multi-tensor) path,
in a real ``Trainer.step`` of SmolLM2-135M-Instruct (full fine-tuning), side by side.

Two trainers on two copies of the model, the same batch (``bench_learner.make_batch``: B
sequences of P prompt + C completion tokens) and ``updates`` optimizer updates a step; one
builds its Adam as the learner does now (``echo_rl.learner.trainer.fusable``: fused where it applies),
the other with the default path (the learner before). Steps alternate between them after a
warm-up; medians and the ratio of the step times are printed and written with the machine.

    .venv/bin/python benchmarks/bench_adam.py [--threads 1] [--reps 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
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

from bench_learner import make_batch  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the learner's default)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=32)
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "adam.json")
    a = ap.parse_args(argv)
    import torch

    from echo_rl.core.config import LearnerConfig, ModelConfig
    from echo_rl.core.machine import write_result
    from echo_rl.core.models import load_model, load_tokenizer
    from echo_rl.learner import trainer as trainer_mod

    torch.set_num_threads(a.threads)
    cfg = ModelConfig(name=a.model)
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tok)
    batch, _ = make_batch(
        argparse.Namespace(
            seed=0,
            batch=a.batch,
            prompt_len=a.prompt_len,
            completion_len=a.completion_len,
            ragged=False,
        ),
        model,
        tok,
    )
    lc = LearnerConfig(lr=1e-6, updates_per_step=a.updates)
    fused = trainer_mod.Trainer(copy.deepcopy(model), lc)
    default = trainer_mod.Trainer(model, lc)
    default.optimizer = torch.optim.Adam(
        [p for p in default.model.parameters() if p.requires_grad], lr=lc.lr
    )  # the learner's optimizer before: the default path
    arms = {"default": default, "fused": fused}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for t in arms.values():  # warm-up
        t.step(batch)
    for rep in range(a.reps):
        for name in list(arms) if rep % 2 == 0 else list(reversed(arms)):
            t0 = time.perf_counter()
            arms[name].step(batch)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    result = {
        "command": "benchmarks/bench_adam.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": a.model,
        "params": sum(p.numel() for p in model.parameters()),
        "threads": a.threads,
        "batch": [a.batch, a.prompt_len, a.completion_len],
        "updates": a.updates,
        "fused_flag": fused.optimizer.defaults.get("fused"),
        "step_s": times,
        "step_s_median": med,
        "ratio_default_over_fused": med["default"] / med["fused"],
        "loadavg": os.getloadavg(),
    }
    write_result(a.json, result)
    print(
        f"Trainer.step, {a.batch} x ({a.prompt_len} + {a.completion_len}) tokens, {a.updates} "
        f"updates, {a.threads} thread(s): default Adam {med['default']:.2f} s, fused "
        f"{med['fused']:.2f} s ({result['ratio_default_over_fused']:.2f}x); {a.json}"
    )
    return result


if __name__ == "__main__":
    main()
