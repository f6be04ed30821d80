"""``echo-rl sample RUN_DIR``: what a run's policy generates for its task, any adapter.

    echo-rl sample runs/my-run [--checkpoint N | --untrained] [--n 5] [--samples 2]
        [--temperature T] [--seed 0] [--json FILE]

Loads the run's config (``RUN_DIR/config.toml``) and the weights of its latest checkpoint (or of
the checkpoint after N steps, ``--checkpoint N``; the learner keeps the newest two), or the model
the run started from (``--untrained``). Draws ``--n`` prompts from the run's own adapter
(``[adapter] name`` and options, so a researcher's installed adapter works as well as the
built-in ones), generates ``--samples`` completions per prompt through the worker's backend with
the worker's settings (``worker.max_new_tokens``, ``worker.temperature`` unless
``--temperature``, the adapter's answer restriction) and scores each with the adapter's reward,
exactly as a worker would. Prints a table: the prompt as the model reads it (its token ids
decoded), the completion, the reward, and whether the completion was cut at max_new_tokens.
Multi-turn adapters play whole episodes; the completion is then the episode's transcript (the
policy's decisions and the environment's replies, special tokens shown), the reward its
return, and ``cut`` says it stopped at a limit (a decision at max_new_tokens without
end-of-sequence, or the transcript at the adapter's max_completion_tokens). ``--json`` rows
also carry the prompt's ``task`` dict, and an episode's ``stats`` (the numbers of its ``info``
that a worker sends).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

from echo_rl.core.jsontypes import JsonObject

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from echo_rl.core.wire import Group
    from echo_rl.data.adapter import Adapter
    from echo_rl.data.episodes import EpisodeAdapter
    from echo_rl.worker.backends import Backend


class SampleRow(TypedDict):
    """One sampled completion (or episode), as printed and as ``--json`` writes it."""

    prompt: str  # as the model reads it (token ids decoded)
    completion: str  # an episode: its transcript, special tokens shown
    reward: float
    cut: bool  # stopped at max_new_tokens (an episode: at a limit)
    tokens: int  # completion tokens
    task: JsonObject  # the prompt's task dict
    stats: NotRequired[dict[str, float]]  # an episode's info numbers, as a worker sends them


def sample(
    run_dir: Path,
    n: int = 5,
    samples: int = 2,
    temperature: float | None = None,
    seed: int = 0,
    checkpoint: str = "latest",
    threads: int = 2,
) -> list[SampleRow]:
    """Rows of prompt, completion, reward, cut, tokens, task. ``checkpoint``: ``latest``, a
    number of steps, or ``untrained``. Raises ``ValueError`` with the fix for a bad folder,
    checkpoint or adapter."""
    from echo_rl.cli.commands.evaluate import Scorer, install_policy, resolve_policy, run_config
    from echo_rl.learner.evaluation import seeded_groups

    cfg = run_config(run_dir)
    policy = resolve_policy(run_dir, checkpoint)
    # the run's model, adapter and answer restriction, and the training prompts the seed draws
    scorer = Scorer(
        cfg,
        split="train",
        n=n,
        samples=samples,
        seed=seed,
        threads=threads,
        temperature=temperature,
        keep_initial=policy.path is None,
    )
    backend, adapter, prompts = scorer.backend, scorer.adapter, scorer.prompts
    install_policy(backend, policy, scorer.initial)
    max_new, temp = scorer.max_new, scorer.temperature
    groups = seeded_groups(prompts, samples, seed, "sample")
    try:
        if getattr(adapter, "multi_turn", False):
            from echo_rl.data.episodes import EpisodeAdapter

            if not isinstance(adapter, EpisodeAdapter):
                raise ValueError(
                    f"adapter {type(adapter).__name__} says multi_turn but is no EpisodeAdapter"
                )
            return _episodes(adapter, backend, groups, max_new, temp)
        return _completions(adapter, backend, groups, max_new, temp)
    finally:
        scorer.close()


def _completions(
    adapter: Adapter, backend: Backend, groups: list[Group], max_new: int, temp: float
) -> list[SampleRow]:
    tok = backend.tokenizer
    rows: list[SampleRow] = []
    for g, out in zip(groups, backend.generate(groups, max_new, temp)):
        for s in out:
            gen = list(s.completion_ids)
            text = str(tok.decode(gen, skip_special_tokens=True))
            cut = len(gen) >= max_new and (not gen or gen[-1] != tok.eos_token_id)
            rows.append(
                {
                    "prompt": str(tok.decode(g.prompt_ids, skip_special_tokens=True)),
                    "completion": text,
                    "reward": float(adapter.reward(g.task, gen, text)),
                    "cut": cut,
                    "tokens": len(gen),
                    "task": g.task,
                }
            )
    return rows


def _episodes(
    adapter: EpisodeAdapter, backend: Backend, groups: list[Group], max_new: int, temp: float
) -> list[SampleRow]:
    from echo_rl.data.episodes import backend_generate_fn, episode_cut
    from echo_rl.data.records import episode_stats

    tok = backend.tokenizer
    gen = backend_generate_fn(backend, max_new, temp, groups[0].seed)
    rows: list[SampleRow] = []
    for g, episodes in zip(groups, adapter.rollout(groups, gen)):
        for ep in episodes:
            rows.append(
                {
                    "prompt": _special(tok, g.prompt_ids),
                    "completion": _special(tok, ep.completion_ids),
                    "reward": float(ep.reward),
                    # the worker's rule: a decision at max_new_tokens without end-of-sequence,
                    # or the transcript at the adapter's max_completion_tokens
                    "cut": episode_cut(ep, adapter),
                    "tokens": len(ep.completion_ids),
                    "task": g.task,
                    "stats": episode_stats(ep.info)[0],  # what a worker would send
                }
            )
    return rows


def _special(tok: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Text with special tokens shown (a transcript's turns end with them), padding left out."""
    pad = tok.pad_token_id
    return str(tok.decode([t for t in ids if t != pad], skip_special_tokens=False))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="echo-rl sample", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--checkpoint",
        default="latest",
        metavar="N",
        help="the checkpoint after N steps (default: the latest; the learner keeps the newest two)",
    )
    which.add_argument(
        "--untrained", action="store_true", help="the model the run started from, before any step"
    )
    p.add_argument("--n", type=int, default=5, help="prompts (rows printed: n x samples)")
    p.add_argument("--samples", type=int, default=2, help="completions per prompt (default 2)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default: the run's worker.temperature; 0: greedy)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also write the rows here, each with its prompt's task dict (the printed table leaves it out)",
    )
    args = p.parse_args(argv)
    if args.n < 1 or args.samples < 1:
        print("echo-rl sample: --n and --samples must be at least 1", file=sys.stderr)
        return 2
    try:
        rows = sample(
            args.run_dir,
            args.n,
            args.samples,
            args.temperature,
            args.seed,
            "untrained" if args.untrained else args.checkpoint,
        )
    except (ValueError, OSError) as exc:
        print(f"echo-rl sample: {exc}", file=sys.stderr)
        return 1
    from rich.console import Console
    from rich.table import Table

    label = (
        "untrained"
        if args.untrained
        else (
            "latest checkpoint" if args.checkpoint == "latest" else f"checkpoint {args.checkpoint}"
        )
    )
    t = Table(title=f"{args.run_dir}: {label}", show_lines=True)
    t.add_column("prompt", overflow="fold")
    t.add_column("completion", overflow="fold")
    t.add_column("reward", justify="right")
    t.add_column("cut")
    for r in rows:
        t.add_row(
            r["prompt"][-200:],
            repr(r["completion"])[:400],
            f"{r['reward']:.3f}",
            "yes" if r["cut"] else "",
        )
    Console().print(t)
    mean = sum(r["reward"] for r in rows) / len(rows)
    cut = sum(r["cut"] for r in rows)
    limit = "at a limit" if rows and "stats" in rows[0] else "at max_new_tokens"
    print(f"mean reward {mean:.3f} over {len(rows)} completions; {cut} cut {limit}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
