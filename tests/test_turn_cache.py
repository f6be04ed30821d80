"""A multi-turn rollout's context cache kept from one decision to the next
(echo_rl/worker/backends/turn_cache.py, ``worker.turn_cache``; docs/scheduling.md "Cache-affine
turns"): the same samples and log-probs as prefilling every transcript whole, with a fraction
of the prefill."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from echo_rl.core import wire

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]


def _poker():
    from echo_rl.core.config import load_config
    from echo_rl.data.adapter import load_adapter
    from echo_rl.worker.backends.transformers import TransformersBackend

    # four hands an episode, answers from the action letters: episodes of several decisions
    cfg = load_config(
        ROOT / "examples/quickstart.toml",
        [
            "adapter.name=poker",
            "adapter.presets.poker.hands=4",
            'adapter.presets.poker.answer_letters="fcb"',
            "adapter.presets.poker.max_episode_tokens=600",
            "adapter.presets.poker.generation.max_new_tokens=1",
        ],
    )
    backend = TransformersBackend(cfg.model, threads=1)
    adapter = load_adapter("poker", cfg.adapter.effective_options, backend.tokenizer)
    backend.restrict_answers(None)
    wv = cfg.worker_view()["worker"]
    prompts = adapter.prompts(random.Random(0))
    groups = [
        wire.Group(group_id=f"g{i}", prompt_ids=p.prompt_ids, n=4, seed=100 + i, task=p.task)
        for i, p in zip(range(3), prompts)
    ]
    return backend, adapter, wv, groups


def _rollout(backend, adapter, wv, groups, turn_cache):
    from echo_rl.worker.scoring import generate_and_score

    return generate_and_score(
        backend, adapter, {**wv, "turn_cache": turn_cache}, threading.Event(), groups
    )


def test_the_cache_changes_no_sample_and_saves_most_of_the_prefill():
    from echo_rl.worker.backends import transformers as tb

    backend, adapter, wv, groups = _poker()
    seen = []
    real = tb.TransformersBackend.generate_turn

    def spy(self, prompts, *a, **kw):
        out = real(self, prompts, *a, **kw)
        seen.append(a[-1])  # the rollout's TurnCache
        return out

    tb.TransformersBackend.generate_turn = spy
    try:
        cached = _rollout(backend, adapter, wv, groups, True)
    finally:
        tb.TransformersBackend.generate_turn = real
    whole = _rollout(backend, adapter, wv, groups, False)
    assert len(cached) == len(whole) == 3
    decisions = 0
    for gc, gw in zip(cached, whole, strict=True):
        for (sc, rc), (sw, rw) in zip(gc, gw, strict=True):
            assert sc.completion_ids == sw.completion_ids and rc == rw
            assert sc.loss_mask == sw.loss_mask
            assert max(abs(a - b) for a, b in zip(sc.logprobs, sw.logprobs)) < 1e-4
            decisions += sum(
                1 for i, m in enumerate(sc.loss_mask) if m and (i == 0 or not sc.loss_mask[i - 1])
            )
    turns = seen[0]
    assert len(seen) > 3 and decisions > 12  # episodes of several decisions
    assert turns.prefill_tokens < 0.5 * turns.fresh_tokens


def test_a_prompt_that_does_not_continue_its_row_starts_afresh():
    import torch

    from echo_rl.worker.backends.turn_cache import TurnCache

    t = TurnCache(pad=0)
    first = t.plan([[3, 4], [5, 6, 7]], "cpu")
    assert first.cache is None and first.new_tokens == 5
    seq = torch.tensor([[0, 3, 4, 9, 1], [5, 6, 7, 8, 1]])
    t.keep([[3, 4], [5, 6, 7]], first, seq, [2, 2], object())
    assert t.seqs == [[3, 4, 9, 1], [5, 6, 7, 8, 1]]
    assert t._match([[3, 4, 9, 1, 12], [5, 6, 7, 8, 1, 13]]) == [0, 1]
    assert t._match([[5, 6, 7, 8, 1, 13]]) == [1]  # the first episode ended
    assert t._match([[3, 4, 10]]) is None  # another transcript: no reuse


def test_a_learner_s_junk_turn_cache_is_off():
    backend, adapter, wv, groups = _poker()
    for junk in ("yes", 1, None, [True]):
        out = _rollout(backend, adapter, {**wv, "turn_cache": junk}, groups[:1], junk)
        assert len(out) == 1 and len(out[0]) == 4


def test_the_model_reads_only_what_is_new():
    """The saving is real, not only counted: after the first decision, each call's first
    forward pass (the prefill) is as wide as the newest segment, not the transcript."""
    backend, adapter, wv, groups = _poker()
    widths: list[int] = []
    forward = backend.model.forward

    def spy(*args, **kw):
        ids = kw.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            widths.append(ids.shape[1])
        return forward(*args, **kw)

    backend.model.forward = spy
    _rollout(backend, adapter, wv, groups[:1], True)
    cached, widths[:] = list(widths), []
    _rollout(backend, adapter, wv, groups[:1], False)
    assert len(cached) == len(widths) >= 3
    assert cached[0] == widths[0]  # the first decision reads its prompt either way
    assert all(c < w for c, w in zip(cached[2:], widths[2:]))  # later, only the new segment
    assert sum(cached) < 0.6 * sum(widths)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_poker_run_with_the_turn_cache_passes_every_audit(tmp_path):
    """A learner and a worker playing poker with worker.turn_cache on, every group audited
    (the learner recomputes the behaviour log-probs of whole transcripts, prefilled from
    scratch): the log-probs the cached decisions carried pass, and nothing is refused."""
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    argv = [
        sys.executable, "-m", "echo_rl.cli.rl", "quickstart", "--config", "examples/quickstart.toml",
        "--run-dir", str(run), "--workers", "1", "--set", "learner.max_steps=4",
        "--set", "adapter.name=poker", "--set", "adapter.presets.poker.hands=4",
        "--set", "adapter.presets.poker.max_episode_tokens=600",
        "--set", "worker.turn_cache=true", "--set", "learner.prompts_per_step=4",
        "--set", "security.audit_rate=1.0",
    ]  # fmt: skip
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=380)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    assert len(rows) == 4
    assert rows[-1]["rejected"] == {} and rows[-1]["audit_failures"] == 0
    assert rows[-1]["audits"] >= 4
