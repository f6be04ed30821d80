"""docs/adapter_api.md is generated from the adapter API's code (echo_rl.data.api_doc): a changed
signature, default or docstring, a new public name or a hook without words fails here."""

import inspect
import re
from pathlib import Path

import pytest

from echo_rl.data import api_doc

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "adapter_api.md"

pytestmark = pytest.mark.timeout(60)


def test_the_page_is_what_the_code_generates():
    assert PAGE.read_text() == api_doc.render(), (
        "docs/adapter_api.md is out of date: .venv/bin/python -m echo_rl.data.api_doc > docs/adapter_api.md"
    )
    assert api_doc.main(["--check", str(PAGE)]) == 0


def test_a_changed_signature_makes_the_check_fail(monkeypatch, tmp_path):
    """What a drift looks like: a hook given another parameter, or another default."""
    from echo_rl.data.episodes import EpisodeAdapter

    def episode(self, task, seed, sample_idx, turns: int = 4):
        """One episode."""

    episode.__isabstractmethod__ = True
    page = tmp_path / "adapter_api.md"
    page.write_text(api_doc.render())
    monkeypatch.setattr(EpisodeAdapter, "episode", episode)
    assert api_doc.main(["--check", str(page)]) == 1
    assert "turns: int = 4" in api_doc.render()
    monkeypatch.undo()
    monkeypatch.setattr(EpisodeAdapter, "max_completion_tokens", 2048)
    assert api_doc.main(["--check", str(page)]) == 1


def test_every_public_name_and_hook_is_on_the_page():
    text = PAGE.read_text()
    headings = [h for h in text.splitlines() if h.startswith("#")]
    for mod, name, obj in api_doc._public():
        assert any(re.search(rf"`{re.escape(name)}[`(]", h) for h in headings), f"{mod}.{name}"
        if isinstance(obj, type):
            for member, _ in api_doc._members(obj):
                assert any(f"`{member}" in h for h in headings), f"{mod}.{name}.{member}"
    assert api_doc.undocumented() == []


def test_the_contract_is_stated_where_researchers_asked():
    """Issue 37's questions, answered on the page: what episode yields, env-token log-probs,
    the seed, determinism, recomputes_rewards and max_completion_tokens' relation."""
    text = " ".join(PAGE.read_text().split())
    from echo_rl.data.adapter import Adapter
    from echo_rl.data.episodes import EpisodeAdapter

    assert "the whole context the policy continues" in text
    assert "0.0 on environment tokens" in text
    assert "`seed` is the group's" in text and "deterministic" in text
    assert f"| `recomputes_rewards` | `bool` | `{Adapter.recomputes_rewards}` |" in text
    assert f"| `recomputes_rewards` | `bool` | `{EpisodeAdapter.recomputes_rewards}` |" in text
    assert f"| `max_completion_tokens` | `int` | `{EpisodeAdapter.max_completion_tokens}` |" in text
    assert "max(worker.max_new_tokens, max_completion_tokens)" in text
    assert str(inspect.signature(Adapter.heldout_prompts)).split("->")[0].count("rng") == 1
    assert "heldout_prompts(self, rng: random.Random) -> Iterator[Prompt] | None" in text
