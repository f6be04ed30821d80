"""``docs/adapter_api.md``, generated from the adapter API's code.

    .venv/bin/python -m echo_rl.data.api_doc > docs/adapter_api.md      # regenerate
    .venv/bin/python -m echo_rl.data.api_doc --check docs/adapter_api.md

Every public class, method, hook, field and function of ``echo_rl.data.adapter``,
``echo_rl.data.episodes`` and ``echo_rl.data.multiturn`` (and the ``Record`` that ``materialise``
receives): its signature as written, each field's type and default with the comment written
above it, and its docstring, which states the contract. ``tests/test_adapter_api_doc.py`` fails
when the committed page differs from what this prints (a changed signature, default or
docstring), when a public name of those modules is missing from the page, and when a public
method or function has no docstring.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

from echo_rl.core.config_doc import field_notes, page_cli

MODULES = ("echo_rl.data.adapter", "echo_rl.data.episodes", "echo_rl.data.multiturn")
# Public names that are not part of what an adapter author uses (the worker's and learner's
# plumbing), listed so that the completeness check still covers every new name.
INTERNAL = {
    "echo_rl.data.adapter": {"ENTRY_POINT_GROUP"},
    "echo_rl.data.episodes": {
        "replay_of",
        "backend_generate_fn",
        "GroupBackend",
        "materialise_masked",
        "decision_cut",
        "episode_cut",
    },
    "echo_rl.data.multiturn": set(),
}

HEADER = """# Adapter API reference

Generated from the code (`echo_rl/data/adapter.py`, `echo_rl/data/episodes.py`,
`echo_rl/data/multiturn.py`, `echo_rl/data/records.py`) by `python -m echo_rl.data.api_doc`;
`tests/test_adapter_api_doc.py` checks that this page matches the code. Signatures, types and
defaults are the code's; the words are the docstrings and the comments above each field. The
guide with worked examples (a single-turn and a multi-turn tutorial) is `docs/adapters.md`.

The contract in short:

- **Where things run.** The learner calls `prompts`, `heldout_prompts` and `materialise`;
  workers call `reward` (single-turn) or `rollout` -> `episode` (multi-turn). Both build the
  adapter from the same run config with `(options, tokenizer)`.
- **Determinism.** `prompts` and `heldout_prompts` draw every choice from their `rng`;
  `reward` is a function of its arguments; an episode is a function of `(task, seed,
  sample_idx)` and the decisions it receives.
- **What is trained.** Single-turn: every completion token. Multi-turn: the tokens an
  `EpisodeSample.loss_mask` marks 1 (the policy's own), never environment tokens, whose
  log-probs are 0.0 and unused.
- **What the learner recomputes.** The log-prob of every trained token under the current
  policy at the step's start and under the reference model (`learner.beta`); a worker's
  log-probs are the behaviour policy's, used for the importance ratio and audited. Rewards only
  where `recomputes_rewards` is true (`Adapter`: true; `EpisodeAdapter`: false).
- **Lengths.** `worker.max_new_tokens` bounds one generation (a single-turn completion, or one
  decision of an episode); `EpisodeAdapter.max_completion_tokens` bounds an episode's whole
  transcript, and the learner admits multi-turn records and prefixes up to
  `max(worker.max_new_tokens, max_completion_tokens)` tokens.
"""


def _text(doc: str | None) -> str:
    """A docstring as Markdown: paragraphs kept, lines joined, ``x`` -> `x`."""
    doc = inspect.cleandoc(doc or "")
    paras = [" ".join(p.split()) for p in doc.split("\n\n") if p.strip()]
    return "\n\n".join(paras).replace("``", "`")


def _sig(name: str, obj: object) -> str:
    """``name(params) -> ret`` with the annotations as written (they are strings here)."""
    if not callable(obj):  # nothing to call, no signature (inspect would say so)
        return name
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params, star = [], False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        text = p.name if p.kind is not p.VAR_POSITIONAL else f"*{p.name}"
        if p.annotation is not p.empty:
            text += f": {_ann(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        params.append(text)
    ret = f" -> {_ann(sig.return_annotation)}" if sig.return_annotation is not sig.empty else ""
    return f"{name}({', '.join(params)}){ret}"


def _ann(ann: object) -> str:
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
    return text.strip("'\"").replace("typing.", "")


def _default(value: object) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _field_words(cls: type) -> dict[str, str]:
    own = [n for n in inspect.get_annotations(cls) if not n.startswith("_")]
    try:
        notes = field_notes(cls)
    except (OSError, TypeError, IndexError):
        notes = {}
    return {n: notes.get(n, "") for n in own}


def _fields(cls: type) -> list[str]:
    """The fields and class attributes annotated in ``cls``'s own body."""
    own = inspect.get_annotations(cls)
    if not own:
        return []
    try:
        notes = field_notes(cls)
    except (OSError, TypeError, IndexError):
        notes = {}
    dc = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, ann in own.items():
        if name.startswith("_"):
            continue
        if name in dc:
            f = dc[name]
            value = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
        else:
            value = cls.__dict__.get(name, dataclasses.MISSING)
        ann = str(ann).replace("|", "\\|")
        note = notes.get(name, "").replace("``", "`")
        rows.append(f"| `{name}` | `{ann}` | {_default(value)} | {note} |")
    return rows + [""]


def _members(cls: type) -> list[tuple[str, property | types.FunctionType]]:
    """Public methods and properties defined in ``cls`` itself (a dataclass's generated
    ``__init__`` is its fields table)."""
    out: list[tuple[str, property | types.FunctionType]] = []
    for name, obj in cls.__dict__.items():
        if name.startswith("_") and name not in ("__init__", "__len__"):
            continue
        if name == "__init__" and dataclasses.is_dataclass(cls):
            continue
        if isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
        if isinstance(obj, (property, types.FunctionType)):
            out.append((name, obj))
    return out


def undocumented() -> list[str]:
    """Public classes, fields, methods and functions of the API without words (a docstring, or
    a comment above or beside a field): the contract must be written down."""
    missing = []
    from echo_rl.data.records import Record

    for mod, name, obj in [*_public(), ("echo_rl.data.records", "Record", Record)]:
        if isinstance(obj, type):
            missing += [f"{mod}.{name}.{f}" for f in _field_words(obj) if not _field_words(obj)[f]]
            missing += [
                f"{mod}.{name}.{m}" for m, f in _members(obj) if not (f.__doc__ or "").strip()
            ]
            if not (obj.__doc__ or "").strip():
                missing.append(f"{mod}.{name}")
        elif name not in ALIASES and not (getattr(obj, "__doc__", "") or "").strip():
            missing.append(f"{mod}.{name}")
    return missing


def _public() -> list[tuple[str, str, object]]:
    import importlib

    out: list[tuple[str, str, object]] = []
    for mod in MODULES:
        m = importlib.import_module(mod)
        for name, obj in vars(m).items():
            if name.startswith("_") or name in INTERNAL[mod]:
                continue
            defined_here = getattr(obj, "__module__", None) == mod
            alias = mod == "echo_rl.data.episodes" and name in (
                "Generated",
                "GenerateFn",
                "Episode",
            )
            if (isinstance(obj, type) or inspect.isfunction(obj)) and defined_here or alias:
                out.append((mod, name, obj))
    return out


def _class(name: str, cls: type) -> list[str]:
    bases = [b.__name__ for b in cls.__bases__ if b not in (object,) and b.__name__ != "ABC"]
    head = f"### class `{name}`" + (f" ({', '.join(bases)})" if bases else "")
    rows = [head, "", _text(cls.__doc__), ""]
    rows += _fields(cls)
    for m, obj in _members(cls):
        if isinstance(obj, property):
            rows += [f"#### property `{m}`", "", _text(obj.__doc__), ""]
            continue
        abstract = (
            " (abstract: implement it)" if getattr(obj, "__isabstractmethod__", False) else ""
        )
        rows += [f"#### `{_sig(m, obj)}`{abstract}", "", _text(obj.__doc__), ""]
    return rows


ALIASES = {
    "Generated": "`(generated_ids, logprobs)` for one decision: the ids as generated (the "
    "end-of-sequence token included when the model produced one) and one behaviour "
    "log-prob per id.",
    "GenerateFn": "What `rollout` receives: the worker's batched generation, one call per round "
    "of decisions across all episodes; each context is continued for at most "
    "`worker.max_new_tokens` tokens under the installed snapshot.",
    "Episode": "What `episode` returns: a generator that yields contexts (list of ids), is sent "
    "a `Generated`, and returns an `EpisodeSample`.",
}


def render() -> str:
    from echo_rl.data import episodes
    from echo_rl.data.records import Record

    parts = [HEADER]
    current = None
    for mod, name, obj in _public():
        if mod != current:
            current = mod
            parts += [f"## `{mod}`", "", _text(sys.modules[mod].__doc__).split("\n\n")[0], ""]
            if mod == "echo_rl.data.episodes":
                parts += [
                    f"### type `{a}` = `{getattr(episodes, a)}`".replace("typing.", "").replace(
                        "collections.abc.", ""
                    )
                    + f"\n\n{ALIASES[a]}\n"
                    for a in ALIASES
                ]
        if name in ALIASES:
            continue
        if isinstance(obj, type):
            parts += _class(name, obj)
        else:
            parts += [f"### `{_sig(name, obj)}`", "", _text(obj.__doc__), ""]
    parts += [
        "## `echo_rl.data.records`",
        "",
        (
            "What `materialise` receives: lists of whole groups of `Record`s, each validated "
            "field by field at admission (docs/adapters.md, 'Records')."
        ),
        "",
    ]
    parts += _class("Record", Record)
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    return page_cli(
        argv,
        render,
        "Print docs/adapter_api.md from the adapter API's code.",
        "echo_rl.data.api_doc",
    )


if __name__ == "__main__":
    sys.exit(main())
