"""Final-answer extraction and bounded-time equivalence checking with ``math-verify``.

Extraction: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
otherwise the last number in the text (``-12``, ``3.5``, ``1,000``, ``3/4``).

Checking: two plain numbers (integers, decimals, ``a/b``) are compared exactly with
``fractions.Fraction`` in-process (no parser needed, microseconds). Everything else goes to
``math-verify`` (symbolic and LaTeX equivalence) **in a child process**:

* ``math-verify`` bounds its own parsing and comparison with ``signal.alarm``, which works only
  in a process's main thread. The worker scores samples from a thread
  (``asyncio.to_thread``), so we cannot call it there with its timeouts on, and with them off a
  pathological expression (a huge power, a nested radical) could hang a worker forever.
* The child (``multiprocessing`` *spawn* context: no fork of a threaded process) runs
  ``math-verify`` in its own main thread with its timeouts on (``timeout_s`` each for parsing
  and verifying), and the parent waits at most ``3 * timeout_s + 1`` seconds for the answer.
  If the child overruns (or dies), the parent kills it, counts a timeout, scores the sample as
  wrong and starts a fresh child on the next call. So one ``equal()`` call is bounded by
  about ``3 * timeout_s + 1`` seconds, plus the child's start-up (import of sympy, ~1-2 s, once).
* Calls are serialised with a lock, so the checker is safe to share between threads.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import re
import threading
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

log = logging.getLogger("echo.adapters.math")

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_PLAIN = re.compile(r"^\s*[-+]?(\d+(\.\d*)?|\.\d+)(\s*/\s*\d+)?\s*$")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` with balanced braces, or None."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = text[m.end() : i - 1].strip()
    return best


def extract_answer(text: str) -> str | None:
    """The final answer in a completion: last ``\\boxed{}``, else the last number, else None."""
    boxed = last_boxed(text)
    if boxed:
        return boxed
    nums = _NUMBER.findall(text)
    return nums[-1].replace(" ", "") if nums else None


def as_fraction(s: str) -> Fraction | None:
    """An exact value for a plain number (``12``, ``-3.50``, ``1,000``, ``3/4``), else None."""
    s = s.strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    if not _PLAIN.match(s):
        return None
    try:
        return Fraction(s.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


# ----------------------------------------------------------------------------- the child


def _serve(
    conn: Connection[str | bool, tuple[str, str]], timeout_s: int
) -> None:  # runs in the child process, its main thread
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # math-verify logs parse failures at warning level
    from math_verify import parse, verify

    conn.send("ready")
    while True:
        try:
            gold, pred = conn.recv()
        except EOFError:
            return
        try:
            g = parse(f"${gold}$", parsing_timeout=timeout_s)
            p = parse(f"${pred}$", parsing_timeout=timeout_s)
            ok = bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=timeout_s))
        except Exception:  # a parse/verify failure or its own timeout: not equal
            ok = False
        conn.send(ok)


class MathChecker:
    """``equal(gold, pred)`` with bounded time; see the module docstring."""

    def __init__(self, timeout_s: float = 5.0, startup_timeout_s: float = 120.0):
        self.timeout_s = max(1, int(round(timeout_s)))
        self.startup_timeout_s = startup_timeout_s
        self.stats = {"fast": 0, "verified": 0, "timeouts": 0}
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None
        atexit.register(self.close)

    @property
    def call_budget_s(self) -> float:
        return 3 * self.timeout_s + 1.0

    def equal(self, gold: str, pred: str) -> bool:
        fg, fp = as_fraction(gold), as_fraction(pred)
        if fg is not None and fp is not None:
            self.stats["fast"] += 1
            return fg == fp
        with self._lock:
            self.stats["verified"] += 1
            return self._ask(gold, pred)

    def _ask(self, gold: str, pred: str) -> bool:
        try:
            if self._proc is None:
                self._start()
            self._conn.send((gold, pred))
            if self._conn.poll(self.call_budget_s):
                return bool(self._conn.recv())
        except (EOFError, OSError, BrokenPipeError):
            pass
        self.stats["timeouts"] += 1
        log.warning(
            "math-verify gave no answer within %.0fs for %r vs %r; scored as wrong and "
            "restarting the checker",
            self.call_budget_s,
            gold[:80],
            pred[:80],
        )
        self._kill()
        return False

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_serve, args=(child, self.timeout_s), daemon=True, name="echo-math-verify"
        )
        proc.start()
        child.close()
        if not parent.poll(self.startup_timeout_s) or parent.recv() != "ready":
            proc.kill()
            raise OSError("math-verify checker did not start")
        self._proc, self._conn = proc, parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._kill()
