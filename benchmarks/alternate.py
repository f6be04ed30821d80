"""Runs of two (or more) settings taken in turn, round by round, and their result file: the
shape of every before/after benchmark on a shared machine (a setting measured first in one
round is measured last in the next, so a drift in the machine's load falls on both)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from echo_rl.core.machine import write_result


def alternate(
    modes: Sequence[Any],
    rounds: int,
    run: Callable[[Any, Path], dict[str, Any]],
    line: Callable[[dict[str, Any]], str],
    prefix: str,
) -> list[dict[str, Any]]:
    """``run(mode, scratch_folder)`` for every mode, ``rounds`` times, the order reversed
    every other round; ``line(result)`` is printed after each run."""
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for i in range(rounds):
            for mode in modes if i % 2 == 0 else list(modes)[::-1]:
                out.append(run(mode, Path(tmp)))
                print(f"round {i + 1}, {line(out[-1])}", flush=True)
    return out


def save(args: argparse.Namespace, script: str, fields: dict[str, Any]) -> None:
    """The result file (``args.json``) with the machine, the script and its parameters."""
    params = vars(args) | {"json": str(args.json)}
    write_result(args.json, {"generated_by": script, "params": params, **fields})
    print(f"wrote {args.json}")
