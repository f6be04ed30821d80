"""``echo-rl eval --run-dir RUN``: the mean reward of a run's policy on its own task, any adapter,
with a 95 % confidence interval; two policies compared on the same prompts and sampling seeds.

    echo-rl eval --run-dir RUN [--checkpoint N|best | --untrained] [--as-sampled]
        [--compare N|latest|best|untrained]
    echo-rl eval --config FILE [--set KEY=VALUE ...] --untrained   # before any run
        [--split auto|train|heldout] [--n 100] [--samples 1] [--temperature T] [--seed 0] [--json]

The run's config (``RUN/config.toml``) names the model, the adapter and its options, the
generation settings and, for a LoRA run, the adapter's shape. The policy is the latest checkpoint
(``RUN/checkpoints/latest``), the one after N steps (``--checkpoint N``, the file
``after-0000000N.pt``; the learner keeps the newest two), the one the run's held-out
evaluation scored best (``--checkpoint best``, ``checkpoints/best.pt``), or the model the run started from
(``--untrained``); with ``--as-sampled``, that checkpoint as workers sampled it (the snapshot the learner
published for its version: ``broadcast.dtype``, ``broadcast.rounding``). Generation goes through the worker's transformers backend, with the run's answer restriction, ``worker.max_new_tokens`` and
``worker.temperature`` (unless ``--temperature``); multi-turn adapters play whole episodes.

Prompts come from the adapter's held-out split when it declares one (``--split auto``, the
default; ``Adapter.heldout_prompts``), else from its training stream. A finite split is scored
once per prompt, at most ``--n`` of them. Each prompt's reward is the mean of its ``--samples``
completions; the interval is Student's t over prompts (``echo_rl/core/ci.py``). With ``--compare``, both
policies see the same prompts with the same sampling seeds, and the paired difference
(evaluated minus compared) gets its own interval.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

from echo_rl.learner.evaluation import (
    BATCH,
    SPLITS,
    EvalError,
    Policy,
    Scorer,
    as_sampled,
    eval_prompts,
    install_policy,
    load_backend,
    resolve_policy,
    run_config,
    score,
    take,
)

# The scoring lives in echo_rl/learner/evaluation.py (the learner's in-run evaluation uses it too);
# these names stay importable from here.
__all__ = [
    "BATCH",
    "SPLITS",
    "EvalError",
    "Policy",
    "Scorer",
    "as_sampled",
    "describe",
    "eval_prompts",
    "evaluate",
    "install_policy",
    "load_backend",
    "main",
    "resolve_policy",
    "run_config",
    "score",
    "take",
]

if TYPE_CHECKING:
    from echo_rl.core.ci import MeanCIJson
    from echo_rl.core.config import EchoConfig

# ----------------------------------------------------------------- the command


class PolicyScore(TypedDict):
    """One policy's line of ``evaluate``'s result."""

    policy: str  # its label (latest, untrained, a step count, as sampled)
    checkpoint: str | None  # its file; None: the model the run started from
    reward: MeanCIJson  # mean reward over prompts, 95 % interval
    per_prompt: list[float]  # each prompt's mean reward


class PairedDifference(TypedDict):
    """``--compare``: the second policy's per-prompt rewards minus the first's."""

    difference: str  # "B - A", by label
    mean: float
    lo: float
    hi: float
    n: int
    std: float
    excludes_zero: bool  # the interval excludes 0: a difference is shown


class EvalResult(TypedDict):
    """What ``echo-rl eval --json`` prints."""

    run_dir: str | None  # None: a score before any run (--config)
    adapter: str
    split: str
    prompts: int
    samples: int
    temperature: float
    max_new_tokens: int
    seed: int
    lora: bool
    policies: list[PolicyScore]
    paired: NotRequired[PairedDifference]


def evaluate(
    run_dir: Path | None,
    policy: str = "latest",
    compare: str | None = None,
    split: str = "auto",
    n: int = 100,
    samples: int = 1,
    temperature: float | None = None,
    seed: int = 0,
    threads: int = 2,
    config: EchoConfig | None = None,
    sampled: bool = False,
) -> EvalResult:
    """The result as a dict (what ``--json`` prints). Without a run folder (``run_dir``
    None), ``config`` (an ``EchoConfig``) names the model and task, and only the untrained
    model can be scored: a score before any run. ``sampled``: the evaluated policy as workers
    sampled it (``as_sampled``)."""
    from echo_rl.core.ci import mean_ci, paired_ci

    if run_dir is None:
        if config is None or policy != "untrained" or compare is not None or sampled:
            raise EvalError(
                "--config scores the model a run would start from (--untrained); a "
                "checkpoint, --as-sampled or --compare needs the run's folder: pass --run-dir"
            )
        cfg = config
        policies = [resolve_policy(Path("."), "untrained")]
    else:
        cfg = run_config(run_dir)
        policies = [resolve_policy(run_dir, policy)]
        if sampled:
            policies = [as_sampled(policies[0], cfg)]
        if compare is not None:
            policies.insert(0, resolve_policy(run_dir, compare))
    scorer = Scorer(
        cfg,
        split=split,
        n=n,
        samples=samples,
        seed=seed,
        threads=threads,
        temperature=temperature,
        keep_initial=any(p.path is None for p in policies),
    )
    try:
        per_prompt = [scorer.score(p) for p in policies]
    finally:
        scorer.close()
    prompts, used, temp, max_new = scorer.prompts, scorer.split, scorer.temperature, scorer.max_new
    res: EvalResult = {
        "run_dir": str(run_dir) if run_dir is not None else None,
        "adapter": cfg.adapter.name,
        "split": used,
        "prompts": len(prompts),
        "samples": samples,
        "temperature": temp,
        "max_new_tokens": max_new,
        "seed": seed,
        "lora": cfg.learner.lora.enabled,
        "policies": [
            {
                "policy": p.label,
                "checkpoint": str(p.path) if p.path else None,
                "reward": mean_ci(r).as_dict(),
                "per_prompt": [round(x, 6) for x in r],
            }
            for p, r in zip(policies, per_prompt)
        ],
    }
    if compare is not None:
        d = paired_ci(per_prompt[0], per_prompt[1])
        res["paired"] = {
            "difference": f"{policies[1].label} - {policies[0].label}",
            **d.as_dict(),
            "excludes_zero": d.lo > 0 or d.hi < 0,
        }
    return res


def describe(res: EvalResult) -> str:
    """The printed form of ``evaluate``'s result."""
    lines = [
        f"{res['run_dir'] or 'before any run'}: {res['adapter']}, split {res['split']}, "
        f"{res['prompts']} prompts x "
        f"{res['samples']} samples, temperature {res['temperature']}, seed {res['seed']}"
        + (" (LoRA)" if res["lora"] else "")
    ]
    width = max(len(p["policy"]) for p in res["policies"])
    for p in res["policies"]:
        r = p["reward"]
        lines.append(
            f"  {p['policy']:<{width}}  mean reward {r['mean']:.4f}  "
            f"95% CI [{r['lo']:.4f}, {r['hi']:.4f}]"
        )
    if "paired" in res:
        d = res["paired"]
        verdict = "excludes 0" if d["excludes_zero"] else "includes 0: no difference shown"
        lines.append(
            f"  paired difference ({d['difference']}): {d['mean']:+.4f}  "
            f"95% CI [{d['lo']:+.4f}, {d['hi']:+.4f}] ({verdict})"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="echo-rl eval",
        description="The mean reward of a run's policy on its own task, any "
        "adapter, with a 95 % confidence interval; --compare: the paired difference.",
        epilog="Also: echo-rl eval poker ... (chips against each opponent) and echo-rl eval "
        "math ... (accuracy of a model folder on a JSONL); each has its own --help.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", type=Path, help="the run folder (config.toml, checkpoints/)")
    where.add_argument(
        "--config",
        type=Path,
        help="a config file instead of a run: score the model it would start from, before "
        "any run (with --untrained; --set overrides keys)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --config: override a key, e.g. --set adapter.options.path=PATH",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--checkpoint",
        default="latest",
        metavar="N",
        help="the checkpoint of step N, or best (the run's best held-out score, "
        "learner.heldout); default: the latest",
    )
    which.add_argument("--untrained", action="store_true", help="the model the run started from")
    p.add_argument(
        "--as-sampled",
        action="store_true",
        help="the checkpoint as workers sampled it: cast the way the learner published it "
        "(broadcast.dtype, broadcast.rounding); with --compare latest (the same checkpoint): "
        "what the snapshot's precision costs",
    )
    p.add_argument(
        "--compare",
        default=None,
        metavar="N|latest|best|untrained",
        help="also score this policy on the same prompts and seeds, and print the "
        "paired difference (evaluated - compared)",
    )
    p.add_argument(
        "--split",
        choices=SPLITS,
        default="auto",
        help="heldout (the adapter's held-out split), train, or auto: heldout when "
        "the adapter declares one (default)",
    )
    p.add_argument("--n", type=int, default=100, help="prompts (a finite split: at most this many)")
    p.add_argument("--samples", type=int, default=1, help="completions per prompt")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default: the run's worker.temperature)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the sampling")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [f"{k} must be at least 1" for k in ("n", "samples", "threads") if getattr(args, k) < 1]
    if args.temperature is not None and args.temperature <= 0:
        bad.append("--temperature must be above 0 (the worker's sampler; try 0.1 for near-greedy)")
    if bad:
        print(
            f"echo-rl eval: {'; '.join(('--' + b) if not b.startswith('--') else b for b in bad)}",
            file=sys.stderr,
        )
        return 2
    from echo_rl.core.config import ConfigError, load_config
    from echo_rl.core.models import ModelError
    from echo_rl.data.adapter import AdapterError

    if args.overrides and args.config is None:
        print(
            "echo-rl eval: --set goes with --config (a run's folder holds its config)",
            file=sys.stderr,
        )
        return 2
    if args.config is not None and not args.untrained:
        print(
            "echo-rl eval: --config scores the model a run would start from: add --untrained "
            "(a checkpoint needs the run's folder, --run-dir)",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(args.config, args.overrides) if args.config is not None else None
    except ConfigError as err:
        print(f"echo-rl eval: {err}", file=sys.stderr)
        return 2
    try:
        res = evaluate(
            args.run_dir,
            "untrained" if args.untrained else args.checkpoint,
            args.compare,
            args.split,
            args.n,
            args.samples,
            args.temperature,
            args.seed,
            args.threads,
            config,
            args.as_sampled,
        )
    except (EvalError, AdapterError, ModelError) as err:
        print(f"echo-rl eval: {err}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1) if args.json else describe(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
