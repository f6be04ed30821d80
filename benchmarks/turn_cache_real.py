"""The multi-turn context cache on and off (docs/scheduling.md, "Cache-affine turns").

    .venv/bin/python benchmarks/turn_cache_real.py [--rounds 3] [--groups 4] [--n 8]
        [--model tiny|PATH] [--hands 4]

Poker rollouts (``echo_rl/adapters/poker``, ``--hands`` an episode: for the tiny model the quickstart's
compact observations and answers from the action letters; for a real model, ``--model FOLDER``,
the text observations and answers in words of up to 8 tokens) through the
worker's own path (``echo_rl.worker.scoring.generate_and_score``, the transformers backend), with
``worker.turn_cache`` false and true, alternating, ``--rounds`` times each. Per rollout:
episodes, decisions, wall time per episode (the rollout's time over its episodes: they are
played in lockstep), the real tokens prefilled (what each decision's model call had to read
before sampling; without the cache every decision's whole transcript, with it what is new)
and the positions computed for them (padding included). Both modes draw the same samples
(tests/test_turn_cache.py), so the only difference is the prefill. Prints a table; writes
benchmarks/results/turn_cache_real.json with the machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.alternate import save  # noqa: E402


def setup(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any], list[Any]]:
    from echo_rl.core import wire
    from echo_rl.core.config import load_config
    from echo_rl.data.adapter import load_adapter
    from echo_rl.worker.backends.transformers import TransformersBackend

    sets = [
        "adapter.name=poker",
        f"adapter.presets.poker.hands={args.hands}",
        f"adapter.presets.poker.max_episode_tokens={args.episode_tokens}",
    ]
    if args.model == "tiny":  # the compact observations, answers from the action letters
        sets += [
            'adapter.presets.poker.answer_letters="fcb"',
            "adapter.presets.poker.generation.max_new_tokens=1",
        ]
    else:  # a real model reads the text observations and answers in words
        sets += [
            f"model.name={args.model}",
            'adapter.presets.poker.obs_format="text"',
            "adapter.presets.poker.generation.max_new_tokens=8",
        ]
    cfg = load_config(ROOT / "examples/quickstart.toml", sets)
    backend = TransformersBackend(cfg.model, threads=args.threads)
    adapter = load_adapter("poker", cfg.adapter.effective_options, backend.tokenizer)
    backend.restrict_answers(None)
    prompts = adapter.prompts(random.Random(0))
    groups = [
        wire.Group(group_id=f"g{i}", prompt_ids=p.prompt_ids, n=args.n, seed=100 + i, task=p.task)
        for i, p in zip(range(args.groups), prompts)
    ]
    return backend, adapter, cfg.worker_view()["worker"], groups


def one(on: bool, setup_: tuple[Any, Any, dict[str, Any], list[Any]]) -> dict[str, Any]:
    from echo_rl.worker.backends import transformers as tb
    from echo_rl.worker.scoring import generate_and_score

    backend, adapter, wv, groups = setup_
    turns: list[Any] = []
    counted = {"fresh": 0, "calls": 0}
    real_turn, real_gen = tb.TransformersBackend.generate_turn, tb.TransformersBackend.generate

    def spy_turn(self, prompts, *a, **kw):  # the rollout's TurnCache holds the counts
        if not turns:
            turns.append(a[-1])
        return real_turn(self, prompts, *a, **kw)

    def spy_gen(self, groups_, *a, **kw):  # without the cache: every prompt read whole
        counted["fresh"] += sum(len(g.prompt_ids) for g in groups_)
        counted["calls"] += 1
        width = max(len(g.prompt_ids) for g in groups_)
        counted.setdefault("positions", 0)
        counted["positions"] += width * len(groups_)
        return real_gen(self, groups_, *a, **kw)

    tb.TransformersBackend.generate_turn, tb.TransformersBackend.generate = spy_turn, spy_gen
    try:
        t0 = time.perf_counter()
        out = generate_and_score(
            backend, adapter, {**wv, "turn_cache": on}, threading.Event(), groups
        )
        wall = time.perf_counter() - t0
    finally:
        tb.TransformersBackend.generate_turn, tb.TransformersBackend.generate = real_turn, real_gen
    episodes = [s for g in out for s, _ in g]
    decisions = sum(s.info.get("decisions", 0) for s in episodes)
    if on:
        t = turns[0]
        prefill, positions, whole = t.prefill_tokens, t.prefill_positions, t.fresh_tokens
    else:
        prefill, positions, whole = counted["fresh"], counted.get("positions", 0), counted["fresh"]
    return {
        "turn_cache": on,
        "episodes": len(episodes),
        "decisions": decisions,
        "transcript_tokens": sum(len(s.completion_ids) for s in episodes),
        "wall_s": wall,
        "s_per_episode": wall / len(episodes),
        "prefill_tokens": prefill,
        "prefill_positions": positions,
        "prefill_if_whole": whole,
    }


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        f"{'turn_cache':>10}{'episodes':>9}{'decisions':>10}{'s/episode':>11}"
        f"{'prefill tokens':>16}{'positions':>11}{'whole':>9}"
    ]
    for r in runs:
        lines.append(
            f"{str(r['turn_cache']):>10}{r['episodes']:>9}{r['decisions']:>10}"
            f"{r['s_per_episode']:>11.3f}{r['prefill_tokens']:>16,}{r['prefill_positions']:>11,}"
            f"{r['prefill_if_whole']:>9,}"
        )
    for on in (False, True):
        mine = [r for r in runs if r["turn_cache"] == on]
        med = lambda k, mine=mine: statistics.median(r[k] for r in mine)  # noqa: E731
        lines.append(
            f"median turn_cache={on}: {med('s_per_episode'):.3f} s an episode, "
            f"{med('prefill_tokens'):,.0f} tokens prefilled ({med('prefill_positions'):,.0f} "
            f"positions)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--n", type=int, default=8, help="episodes a group")
    ap.add_argument("--hands", type=int, default=4)
    ap.add_argument("--episode-tokens", type=int, default=600)
    ap.add_argument("--model", default="tiny", help="tiny, or a model folder (a real model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/turn_cache_real.json")
    args = ap.parse_args(argv)
    s = setup(args)
    one(False, s)  # warm-up: the first call pays for allocations
    runs = []
    for i in range(args.rounds):
        for on in (False, True) if i % 2 == 0 else (True, False):
            runs.append(one(on, s))
            r = runs[-1]
            print(
                f"round {i + 1}, turn_cache={on}: {r['s_per_episode']:.3f} s an episode, "
                f"{r['prefill_tokens']:,} tokens prefilled",
                flush=True,
            )
    print(table(runs))
    save(args, "benchmarks/turn_cache_real.py", {"runs": runs, "table": table(runs)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
