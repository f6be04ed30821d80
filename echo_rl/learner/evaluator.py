"""The learner's held-out evaluator, a process of its own beside the learner (echo_rl/learner/heldout.py
starts it): ``python -m echo_rl.learner.evaluator --run-dir RUN --prompts N --samples S --seed K
--threads T``.

It loads the run's model, adapter and held-out prompts once (echo_rl/learner/evaluation.py, as
``echo-rl eval --split heldout`` does), says ``{"ready": ...}`` on stdout, then reads lines
``STEPS PATH`` on stdin: for each, it scores the checkpoint file PATH and writes one JSON line,
a ``HeldoutScore`` (``{"score": ...}``). A problem it cannot score past (no held-out split, a
checkpoint that does not fit) is one line ``{"error": "..."}`` naming it, then exit 2. End of
stdin ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path


def _say(doc: Mapping[str, object]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m echo_rl.learner.evaluator")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--prompts", type=int, required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    from echo_rl.core.ci import mean_ci
    from echo_rl.core.models import ModelError
    from echo_rl.data.adapter import AdapterError
    from echo_rl.learner.evaluation import (
        EvalError,
        HeldoutScore,
        Policy,
        Scorer,
        read_state,
        run_config,
    )

    try:
        scorer = Scorer(
            run_config(args.run_dir),
            split="heldout",
            n=args.prompts,
            samples=args.samples,
            seed=args.seed,
            threads=args.threads,
        )
    except (EvalError, AdapterError, ModelError) as err:
        _say({"error": str(err)})
        return 2
    try:
        _say({"ready": {"split": scorer.split, "prompts": len(scorer.prompts)}})
        for line in sys.stdin:
            steps_text, _, path_text = line.strip().partition(" ")
            t0 = time.monotonic()
            path = Path(path_text)
            try:
                per = scorer.score(Policy(f"step {steps_text}", path, read_state(path)))
            except (EvalError, OSError) as err:
                _say({"error": f"{path}: {err}"})
                return 2
            ci = mean_ci(per)
            score = HeldoutScore(
                steps=int(steps_text),
                mean=ci.mean,
                lo=ci.lo,
                hi=ci.hi,
                prompts=len(per),
                samples=args.samples,
                per_prompt=tuple(per),
                wall_s=time.monotonic() - t0,
            )
            _say({"score": score.to_json()})
    finally:
        scorer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
