"""``echo-rl eval --run-dir RUN``: the mean reward of a run's policy on its own task, any adapter,
with a 95 % confidence interval; two policies compared on the same prompts and sampling seeds.

    echo-rl eval --run-dir RUN [--checkpoint N | --untrained] [--compare N|latest|untrained]
        [--split auto|train|heldout] [--n 100] [--samples 1] [--temperature T] [--seed 0] [--json]

The run's config (``RUN/config.toml``) names the model, the adapter and its options, the
generation settings and, for a LoRA run, the adapter's shape. The policy is the latest checkpoint
(``RUN/checkpoints/latest``), the one after N steps (``--checkpoint N``, the file
``after-0000000N.pt``; the learner keeps the newest two), or the model the run started from
(``--untrained``). Generation goes through the worker's transformers backend, with the run's answer restriction, ``worker.max_new_tokens`` and
``worker.temperature`` (unless ``--temperature``); multi-turn adapters play whole episodes.

Prompts come from the adapter's held-out split when it declares one (``--split auto``, the
default; ``Adapter.heldout_prompts``), else from its training stream. A finite split is scored
once per prompt, at most ``--n`` of them. Each prompt's reward is the mean of its ``--samples``
completions; the interval is Student's t over prompts (``echo/ci.py``). With ``--compare``, both
policies see the same prompts with the same sampling seeds, and the paired difference
(evaluated minus compared) gets its own interval.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPLITS = ("auto", "train", "heldout")
BATCH = 16  # prompts per generate call


class EvalError(ValueError):
    """A problem with the command's input: the message names it and the fix."""


@dataclass(frozen=True)
class Policy:
    """``untrained``, or a checkpoint of the run, its weights read at once (a live run deletes
    all but its newest two); ``label`` is what the output calls it."""

    label: str
    path: Path | None  # None: the untrained model
    state: dict[str, Any] | None = None  # the checkpoint's "model" tensors


def _read(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)["model"]


# ----------------------------------------------------------------- the run folder


def run_config(run_dir: Path) -> Any:
    from echo.config import ConfigError, load_config

    if not run_dir.is_dir():
        raise EvalError(
            f"--run-dir {run_dir}: no such folder; pass the run folder that echo-rl "
            f"learn or quickstart wrote (it holds config.toml and checkpoints/)"
        )
    if not (run_dir / "config.toml").is_file():
        raise EvalError(
            f"--run-dir {run_dir}: no config.toml there, so it is not an Echo run "
            f"folder; pass the folder that echo-rl learn or quickstart wrote"
        )
    try:
        return load_config(run_dir / "config.toml")
    except ConfigError as err:
        raise EvalError(f"{run_dir}/config.toml: {err}") from None


def _kept(run_dir: Path) -> dict[int, Path]:
    """Steps taken -> checkpoint file (``after-N.pt``, or a run folder's older ``step-K.pt``)."""
    from learner.checkpoint import kept_checkpoints

    return kept_checkpoints(run_dir)


def resolve_policy(run_dir: Path, which: str) -> Policy:
    """``which``: ``untrained``, ``latest`` or a step number."""
    if which == "untrained":
        return Policy("untrained", None)
    from learner.checkpoint import steps_of

    ckpt = run_dir / "checkpoints"
    files = _kept(run_dir)
    kept = ", ".join(map(str, files)) or "none"
    if which == "latest":
        for _ in range(3):  # a live run may replace its latest between the two reads
            if not (ckpt / "latest").is_file():
                raise EvalError(
                    f"{run_dir} has no checkpoint ({ckpt}/latest is missing: the run "
                    f"took no step yet, or ran with learner.checkpoint = false); pass "
                    f"--untrained to evaluate the model it starts from"
                )
            path = ckpt / (ckpt / "latest").read_text().strip()
            try:
                return Policy(f"step {steps_of(path.name)}", path, _read(path))
            except FileNotFoundError:
                continue
        raise EvalError(f"{ckpt}: the latest checkpoint kept changing while being read; try again")
    try:
        step = int(which)
    except ValueError:
        raise EvalError(f"checkpoint {which!r}: give a step number, latest or untrained") from None
    from learner.checkpoint import checkpoint_name

    path = files.get(step, ckpt / checkpoint_name(step))
    try:
        return Policy(f"step {step}", path, _read(path))
    except FileNotFoundError:
        raise EvalError(
            f"{run_dir} has no checkpoint of step {step} ({path}); the learner keeps "
            f"the newest two, here steps: {kept}. Pass one of them, or leave "
            f"--checkpoint out for the latest, or --untrained"
        ) from None


# ----------------------------------------------------------------- prompts


def eval_prompts(
    adapter: Any, split: str, n: int, seed: int, name: str = ""
) -> tuple[list[Any], str]:
    """Up to ``n`` prompts of ``split`` and the split actually used (``auto``: heldout when
    the adapter declares one, else train)."""
    rng = random.Random(seed)
    if split in ("auto", "heldout"):
        stream = adapter.heldout_prompts(rng)
        if stream is not None:
            return take(stream, n), "heldout"
        if split == "heldout":
            raise EvalError(
                f"adapter {name or type(adapter).__name__!r} declares no "
                f"held-out split with this run's options (docs/adapters.md, "
                f"'Held-out split': toy-add takes heldout = K, math heldout_path); "
                f"pass --split train to score training prompts"
            )
    return take(adapter.prompts(rng), n), "train"


def take(it: Any, n: int) -> list[Any]:
    """The first ``n`` items of ``it`` (shared with ``echo-rl sample``)."""
    out = []
    for p in it:
        out.append(p)
        if len(out) == n:
            break
    return out


# ----------------------------------------------------------------- the policy


def load_backend(cfg: Any, threads: int) -> Any:
    """The worker's default backend (the engine) for the run's model (base + adapter for
    LoRA)."""
    from worker.backends import make_backend

    lora = cfg.learner.lora if cfg.learner.lora.enabled else None
    extra = {"lora": lora} if lora is not None else {}
    return make_backend(
        "engine", model_cfg=cfg.model, threads=threads, device=cfg.worker.device, **extra
    )


def install_policy(backend: Any, policy: Policy, initial: dict[str, Any]) -> None:
    """Load ``policy``'s weights into ``backend.model``: a checkpoint's, or ``initial`` (the
    weights as loaded, the untrained model). A LoRA checkpoint holds the adapter alone."""
    from echo.lora import adapter_parameters, is_peft

    model = backend.model
    if policy.state is None:
        model.load_state_dict(initial)
        return
    sd = policy.state
    if is_peft(model):
        want = set(adapter_parameters(model))
        if set(sd) != want:
            raise EvalError(
                f"{policy.path}: its tensors are not this run's LoRA adapter (the "
                f"[learner.lora] settings in config.toml changed since?)"
            )
        _load(model, sd, policy)
        return
    missing, unexpected = _load(model, sd, policy)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise EvalError(
            f"{policy.path}: the checkpoint does not fit the run's model (missing "
            f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}); "
            f"was config.toml edited after the run?"
        )


def _load(model: Any, sd: dict[str, Any], policy: Policy) -> Any:
    try:
        return model.load_state_dict(sd, strict=False)
    except RuntimeError as exc:  # shapes: another model size or LoRA rank
        first = str(exc).strip().splitlines()[-1].strip()
        raise EvalError(
            f"{policy.path}: the checkpoint does not fit the run's model ({first}); "
            f"was config.toml edited after the run?"
        ) from None


def score(
    backend: Any,
    adapter: Any,
    prompts: list[Any],
    samples: int,
    max_new: int,
    temperature: float,
    seed: int,
) -> list[float]:
    """Each prompt's mean reward over ``samples`` completions. Group seeds depend only on
    ``seed`` and the prompt's index, and batches are the same every call: two policies are
    sampled with the same random numbers."""
    from echo import wire

    groups = [
        wire.Group(
            group_id=f"eval-{i}",
            prompt_ids=p.prompt_ids,
            n=samples,
            seed=(seed * 1_000_003 + i) % (1 << 62),
            task=p.task,
        )
        for i, p in enumerate(prompts)
    ]
    out: list[float] = []
    for i in range(0, len(groups), BATCH):
        batch = groups[i : i + BATCH]
        for rewards in _rewards(backend, adapter, batch, max_new, temperature):
            out.append(sum(rewards) / len(rewards))
    return out


def _rewards(
    backend: Any, adapter: Any, groups: list[Any], max_new: int, temperature: float
) -> list[list[float]]:
    if getattr(adapter, "multi_turn", False):
        from dataplane.episodes import backend_generate_fn

        gen = backend_generate_fn(backend, max_new, temperature, groups[0].seed)
        return [[float(ep.reward) for ep in eps] for eps in adapter.rollout(groups, gen)]
    tok = backend.tokenizer
    out = backend.generate(groups, max_new, temperature)
    return [
        [
            float(
                adapter.reward(
                    g.task, s.completion_ids, tok.decode(s.completion_ids, skip_special_tokens=True)
                )
            )
            for s in samples
        ]
        for g, samples in zip(groups, out)
    ]


# ----------------------------------------------------------------- the command


def evaluate(
    run_dir: Path,
    policy: str = "latest",
    compare: str | None = None,
    split: str = "auto",
    n: int = 100,
    samples: int = 1,
    temperature: float | None = None,
    seed: int = 0,
    threads: int = 2,
) -> dict[str, Any]:
    """The result as a dict (what ``--json`` prints)."""
    from dataplane.adapter import load_adapter
    from dataplane.answers import check_answer_tokens
    from echo.ci import mean_ci, paired_ci

    cfg = run_config(run_dir)
    policies = [resolve_policy(run_dir, policy)]
    if compare is not None:
        policies.insert(0, resolve_policy(run_dir, compare))
    backend = load_backend(cfg, threads)
    adapter = load_adapter(cfg.adapter.name, cfg.adapter.effective_options, backend.tokenizer)
    max_new = cfg.worker.max_new_tokens
    backend.restrict_answers(
        check_answer_tokens(
            adapter.answer_tokens, backend.vocab_size, max_new, backend.tokenizer.eos_token_id
        )
    )
    temp = cfg.worker.temperature if temperature is None else temperature
    try:
        prompts, used = eval_prompts(adapter, split, n, seed, cfg.adapter.name)
        initial = (
            {k: v.detach().clone() for k, v in backend.model.state_dict().items()}
            if any(p.path is None for p in policies)
            else {}
        )
        per_prompt = []
        for p in policies:
            install_policy(backend, p, initial)
            per_prompt.append(score(backend, adapter, prompts, samples, max_new, temp, seed))
    finally:
        close = getattr(adapter, "close", None)
        if callable(close):
            close()
    res: dict[str, Any] = {
        "run_dir": str(run_dir),
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


def describe(res: dict[str, Any]) -> str:
    """The printed form of ``evaluate``'s result."""
    lines = [
        f"{res['run_dir']}: {res['adapter']}, split {res['split']}, {res['prompts']} prompts x "
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
    p.add_argument(
        "--run-dir", type=Path, required=True, help="the run folder (config.toml, checkpoints/)"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--checkpoint",
        default="latest",
        metavar="N",
        help="the checkpoint of step N (default: the latest)",
    )
    which.add_argument("--untrained", action="store_true", help="the model the run started from")
    p.add_argument(
        "--compare",
        default=None,
        metavar="N|latest|untrained",
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
    from dataplane.adapter import AdapterError
    from echo.models import ModelError

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
        )
    except (EvalError, AdapterError, ModelError) as err:
        print(f"echo-rl eval: {err}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1) if args.json else describe(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
