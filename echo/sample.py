"""``echo-rl sample RUN_DIR``: what a trained model generates for its task, any adapter.

    echo-rl sample runs/my-run [--n 5] [--samples 2] [--temperature T] [--seed 0] [--json FILE]

Loads the run's config (``RUN_DIR/config.toml``) and the weights of its latest checkpoint, draws
``--n`` prompts from the run's own adapter (``[adapter] name`` and options, so a researcher's
installed adapter works as well as the built-in ones), generates ``--samples`` completions per
prompt with the worker's settings (``worker.max_new_tokens``, ``worker.temperature`` unless
``--temperature``) and scores each with the adapter's reward, exactly as a worker would. Prints
a table: prompt, completion, reward, and whether the completion was cut at max_new_tokens.
Multi-turn adapters (poker) play whole episodes; the table then shows the episode's transcript
tail and its return.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any


def sample(run_dir: Path, n: int = 5, samples: int = 2, temperature: float | None = None,
           seed: int = 0) -> list[dict[str, Any]]:
    from adapters.hf import HFModel, run_config
    from dataplane.adapter import load_adapter

    cfg = run_config(str(run_dir))
    if cfg is None:
        raise ValueError(f"{run_dir} is not an Echo run folder with a checkpoint (expected "
                         f"{run_dir}/config.toml and {run_dir}/checkpoints/latest): pass the "
                         f"--run-dir of a run that took at least one step")
    model = HFModel(str(run_dir), seed=seed)
    tok = model.tokenizer
    adapter = load_adapter(cfg.adapter.name, cfg.adapter.effective_options, tok)
    model.answer_tokens = adapter.answer_tokens  # the sampler the run trained with
    temp = cfg.worker.temperature if temperature is None else temperature
    max_new = cfg.worker.max_new_tokens
    prompts = _take(adapter.prompts(random.Random(seed)), n)
    if getattr(adapter, "multi_turn", False):
        return _episodes(adapter, model, prompts, samples, max_new, temp, seed)
    rows = []
    for p in prompts:
        for gen, _ in model.generate([p.prompt_ids] * samples, max_new, temp):
            text = tok.decode(gen, skip_special_tokens=True)
            cut = len(gen) >= max_new and (not gen or gen[-1] != tok.eos_token_id)
            rows.append({"prompt": tok.decode(p.prompt_ids, skip_special_tokens=True),
                         "completion": text, "reward": float(adapter.reward(p.task, gen, text)),
                         "cut": cut, "tokens": len(gen)})
    return rows


def _take(it: Any, n: int) -> list[Any]:
    out = []
    for p in it:
        out.append(p)
        if len(out) == n:
            break
    return out


def _episodes(adapter: Any, model: Any, prompts: list[Any], samples: int, max_new: int,
              temp: float, seed: int) -> list[dict[str, Any]]:
    from types import SimpleNamespace

    tok = model.tokenizer

    def generate(batch: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        return model.generate(batch, max_new, temp)

    groups = [SimpleNamespace(task=p.task, n=samples, seed=seed * 1000 + i) for i, p in enumerate(prompts)]
    rows = []
    for g, episodes in zip(groups, adapter.rollout(groups, generate)):
        for ep in episodes:
            text = tok.decode(ep.completion_ids, skip_special_tokens=True)
            rows.append({"prompt": str(g.task)[:120], "completion": text[-400:],
                         "reward": float(ep.reward), "cut": False, "tokens": len(ep.completion_ids)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="echo-rl sample", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--n", type=int, default=5, help="prompts")
    p.add_argument("--samples", type=int, default=2, help="completions per prompt")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the run's worker.temperature; 0: greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if args.n < 1 or args.samples < 1:
        print("echo-rl sample: --n and --samples must be at least 1", file=sys.stderr)
        return 2
    try:
        rows = sample(args.run_dir, args.n, args.samples, args.temperature, args.seed)
    except (ValueError, OSError) as exc:
        print(f"echo-rl sample: {exc}", file=sys.stderr)
        return 1
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{args.run_dir}: latest checkpoint", show_lines=True)
    for col, kw in (("prompt", {"overflow": "fold"}), ("completion", {"overflow": "fold"}),
                    ("reward", {"justify": "right"}), ("cut", {})):
        t.add_column(col, **kw)
    for r in rows:
        t.add_row(r["prompt"][-200:], repr(r["completion"])[:400], f"{r['reward']:.3f}",
                  "yes" if r["cut"] else "")
    Console().print(t)
    mean = sum(r["reward"] for r in rows) / len(rows)
    cut = sum(r["cut"] for r in rows)
    print(f"mean reward {mean:.3f} over {len(rows)} completions; {cut} cut at max_new_tokens")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
