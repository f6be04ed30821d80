"""The run watching its own policy: held-out evaluation while the run trains (learner.heldout,
docs/learner.md "Watching the policy").

Every ``learner.heldout.every`` steps, the checkpoint the release just wrote is handed to the
evaluator, a process of its own beside the learner (echo_rl/learner/evaluator.py: the run's model in the
worker's engine, the adapter's held-out prompts, the same seeds every time), so scoring never
holds up a step; on a CPU it shares the cores, as a worker on the same machine would. The
checkpoint is hard-linked as ``checkpoints/eval-N.pt`` first, so the rotation that keeps the
newest two cannot take it away. When its score comes back it is written to ``heldout.jsonl``
and handed to the step loop (``results``: the next step row carries it), and when it beats
every score before it the file becomes ``checkpoints/best.pt`` with ``best.json`` beside it
(echo_rl/learner/checkpoint.py); otherwise the link goes.

One evaluation runs at a time and at most one waits: a checkpoint offered while another waits
takes its place (the newer policy is the one worth scoring; ``skipped`` counts the others).
The run's last checkpoint is always offered, and the end of a run waits for its score at most
``final_wait_s``. An evaluator that fails (a checkpoint that does not fit, a crash) is named in
the learner's log with the tail of ``heldout.log`` and the run goes on without it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, TYPE_CHECKING

from echo_rl.core.config import HeldoutConfig
from echo_rl.learner.checkpoint import best_checkpoint, keep_best
from echo_rl.learner.evaluation import HeldoutScore

if TYPE_CHECKING:
    from echo_rl.data.adapter import Adapter

log = logging.getLogger("echo.learner")

RESULTS_KEPT = 64  # scores waiting for the step loop; the oldest go first (one per evaluation)


def open_heldout(
    hc: HeldoutConfig, run_dir: Path, max_steps: int, adapter: Adapter, steps: int
) -> HeldoutEval | None:
    """The evaluator for this run, or None when ``learner.heldout.every`` is 0 or the adapter
    declares no held-out split (said in the log: the run trains without it)."""
    if not hc.every:
        return None
    import random

    if adapter.heldout_prompts(random.Random(hc.seed)) is None:
        log.warning(
            "learner.heldout.every=%d, but adapter %s declares no held-out split with this "
            "run's options (docs/adapters.md, 'Held-out split'): the run trains without an "
            "in-run evaluation",
            hc.every,
            type(adapter).__name__,
        )
        return None
    return HeldoutEval(hc, run_dir, max_steps, steps)


class HeldoutEval:
    def __init__(self, hc: HeldoutConfig, run_dir: Path, max_steps: int, steps: int):
        self.hc, self.run_dir, self.max_steps = hc, run_dir, max_steps
        self.ckpt = run_dir / "checkpoints"
        self.ckpt.mkdir(parents=True, exist_ok=True)
        for stale in self.ckpt.glob("eval-*.pt"):  # links an earlier instance left behind
            stale.unlink()
        found = best_checkpoint(run_dir)
        self.best: HeldoutScore | None = None if found is None else found[1]
        self.next_due = steps  # the first checkpoint at or after this is offered
        self.skipped = 0  # checkpoints replaced while waiting
        self.failed: str | None = None  # why the evaluator stopped, if it did
        self._lock = threading.Condition()
        self._busy: tuple[int, Path] | None = None  # being scored
        self._waiting: tuple[int, Path] | None = None  # next
        self._results: deque[HeldoutScore] = deque(maxlen=RESULTS_KEPT)
        self._closing = False
        self._stderr = (run_dir / "heldout.log").open("ab")
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "echo_rl.learner.evaluator",
                "--run-dir",
                str(run_dir),
                "--prompts",
                str(hc.prompts),
                "--samples",
                str(hc.samples),
                "--seed",
                str(hc.seed),
                "--threads",
                str(hc.threads),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._reader = threading.Thread(target=self._read, name="echo-heldout", daemon=True)
        self._reader.start()
        log.info(
            "held-out evaluation every %d steps: %d prompts x %d samples, process %d "
            "(heldout.jsonl, checkpoints/best.pt; its log: heldout.log)",
            hc.every,
            hc.prompts,
            hc.samples,
            self._proc.pid,
        )

    # ------------------------------------------------------------------ the release's side

    def offer(self, steps: int, path: Path) -> None:
        """The checkpoint after ``steps`` steps is written at ``path`` (any thread): scored
        when it is due."""
        if steps < self.next_due and steps < self.max_steps:
            return
        self.next_due = (steps // self.hc.every + 1) * self.hc.every
        link = self.ckpt / f"eval-{steps:08d}.pt"
        with self._lock:
            if self.failed is not None or self._closing:
                return
            link.unlink(missing_ok=True)
            os.link(path, link)
            if self._busy is None:
                self._send(steps, link)
            else:
                if self._waiting is not None:
                    self._waiting[1].unlink(missing_ok=True)
                    self.skipped += 1
                self._waiting = (steps, link)

    def _send(self, steps: int, link: Path) -> None:
        """Under the lock."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(f"{steps} {link}\n")
            self._proc.stdin.flush()
        except OSError as err:  # the evaluator is gone: _read says why
            self._fail(f"the evaluator process took no more work ({err})")
            return
        self._busy = (steps, link)

    # ------------------------------------------------------------------ the step loop's side

    def results(self) -> list[HeldoutScore]:
        """Scores that came back since the last call, oldest first."""
        with self._lock:
            out = list(self._results)
            self._results.clear()
        return out

    def finish(self, timeout: float | None = None) -> None:
        """The end of a run: wait for the evaluations offered (the last checkpoint's among
        them) at most ``timeout`` (default ``final_wait_s``) seconds."""
        wait = self.hc.final_wait_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._lock:
            if self._busy is not None and self.failed is None:
                steps = (self._waiting or self._busy)[0]
                log.info(
                    "waiting up to %.0f s for the held-out evaluation of step %d "
                    "(learner.heldout.final_wait_s)",
                    wait,
                    steps,
                )
            while self._busy is not None and self.failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "held-out evaluation of step %d not done after %.0f s: the run ends "
                        "without it (raise learner.heldout.final_wait_s)",
                        self._busy[0],
                        wait,
                    )
                    return
                self._lock.wait(left)

    def close(self) -> None:
        """Ends the evaluator (an evaluation in progress is dropped) and removes the links."""
        with self._lock:
            self._closing = True
            for item in (self._busy, self._waiting):
                if item is not None:
                    item[1].unlink(missing_ok=True)
            self._busy = self._waiting = None
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass  # already gone: wait() below reaps it
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # in the middle of an evaluation
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)
        self._stderr.close()

    # ------------------------------------------------------------------ the reader thread

    def _read(self) -> None:
        out: IO[str] | None = self._proc.stdout
        assert out is not None
        for line in out:
            try:
                doc = json.loads(line)
            except ValueError:
                continue  # not a message (a library printed to stdout): heldout.log has stderr
            if not isinstance(doc, dict):
                continue
            if "score" in doc:
                try:
                    self._scored(HeldoutScore.from_json(doc["score"]))
                except (OSError, KeyError, TypeError, ValueError) as err:  # a disk, a bad line
                    with self._lock:
                        self._fail(f"a score could not be kept ({type(err).__name__}: {err})")
            elif "error" in doc:
                with self._lock:
                    if not self._closing:  # closing removed the link it was reading
                        self._fail(str(doc["error"]))
            elif "ready" in doc:
                log.info("held-out evaluator ready: %s", doc["ready"])
        with self._lock:
            if not self._closing and self.failed is None:
                code = self._proc.wait()
                self._fail(f"the evaluator process ended (exit {code}): {self._tail()}")

    def _scored(self, score: HeldoutScore) -> None:
        with self._lock:
            busy, self._busy = self._busy, None
            better = self.best is None or score.mean > self.best.mean
            if busy is not None and busy[0] == score.steps:
                if better:
                    keep_best(self.run_dir, busy[1], score)
                    self.best = score
                else:
                    busy[1].unlink(missing_ok=True)
            with (self.run_dir / "heldout.jsonl").open("a") as f:
                f.write(json.dumps({**score.to_json(), "best": better}) + "\n")
            self._results.append(score)
            log.info(
                "held-out score after %d steps: %.3f [%.3f, %.3f] (%d prompts x %d, %.0f s)%s",
                score.steps,
                score.mean,
                score.lo,
                score.hi,
                score.prompts,
                score.samples,
                score.wall_s,
                ": the best so far, checkpoints/best.pt" if better else "",
            )
            if self._waiting is not None and not self._closing:
                waiting, self._waiting = self._waiting, None
                self._send(*waiting)
            self._lock.notify_all()

    def _fail(self, why: str) -> None:
        """Under the lock: the run goes on without in-run evaluation."""
        if self.failed is None:
            log.warning("held-out evaluation stopped, the run goes on without it: %s", why)
        self.failed = why
        for item in (self._busy, self._waiting):
            if item is not None:
                item[1].unlink(missing_ok=True)
        self._busy = self._waiting = None
        self._lock.notify_all()

    def _tail(self) -> str:
        try:
            lines = (self.run_dir / "heldout.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no heldout.log)"
        return " | ".join(line.strip() for line in lines[-3:] if line.strip()) or "(no output)"
