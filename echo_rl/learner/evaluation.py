"""Scoring a run's policy on its own task: the prompts of a split, a policy (a checkpoint of the
run, its best, or the model it started from) installed in the worker's engine, each prompt's mean
reward over seeded samples. ``echo-rl eval`` (echo_rl/cli/commands/evaluate.py) and the learner's
in-run held-out evaluation (echo_rl/learner/heldout.py, echo_rl/learner/evaluator.py) both score through here,
so a figure of one is a figure of the other.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict, TypeVar

from echo_rl.core.errors import EchoError

if TYPE_CHECKING:
    import torch

    from echo_rl.core import wire
    from echo_rl.core.config import EchoConfig
    from echo_rl.data.adapter import Adapter, Prompt
    from echo_rl.learner.parallel.base import ModelState
    from echo_rl.worker.backends import Backend
    from echo_rl.worker.backends.transformers import TransformersBackend

SPLITS = ("auto", "train", "heldout")
BATCH = 16  # prompts per generate call

_T = TypeVar("_T")


class EvalError(EchoError, ValueError):
    """A problem with the command's input: the message names it and the fix."""

    default_reason = "eval_input"


@dataclass(frozen=True)
class Policy:
    """``untrained``, or a checkpoint of the run, its weights read at once (a live run deletes
    all but its newest two); ``label`` is what the output calls it."""

    label: str
    path: Path | None  # None: the untrained model
    state: ModelState | None = None  # the checkpoint's "model" tensors
    steps: int | None = None  # learner steps behind it: its version (None: untrained)
    # installed as the snapshot the learner published for it (``as_sampled``): None, as held
    sampled: Sampled | None = None


@dataclass(frozen=True)
class Sampled:
    """How the learner published a version: what workers install and sample from."""

    dtype: str  # broadcast.dtype
    rounding: str  # broadcast.rounding
    # the version's rounding seed (echo_rl.core.models.rounding_seed); None: nearest
    seed: int | None


def as_sampled(policy: Policy, cfg: EchoConfig) -> Policy:
    """``policy`` as workers sampled it: its weights cast the way the learner published them
    (``broadcast.dtype``, ``broadcast.rounding`` with the version's own seed), so its score
    against the checkpoint's is what the snapshot's precision costs (docs/does-it-learn.md,
    "Snapshot precision")."""
    from echo_rl.core.models import rounding_seed

    if policy.steps is None:
        raise EvalError(
            "--as-sampled scores a checkpoint as workers sampled it; the untrained model is "
            "what every worker loads: pass a checkpoint (--checkpoint N|latest|best)"
        )
    b = cfg.broadcast
    words = {"stochastic": "rounded stochastically", "dither": "dithered"}
    how = f"{b.dtype}, {words.get(b.rounding, 'rounded to nearest')}"
    return dataclasses.replace(
        policy,
        label=f"{policy.label} as sampled ({how})",
        sampled=Sampled(b.dtype, b.rounding, rounding_seed(cfg.seed, b.rounding, policy.steps)),
    )


def read_state(path: Path) -> ModelState:
    import torch

    state: ModelState = torch.load(path, map_location="cpu", weights_only=False)["model"]
    return state


# ----------------------------------------------------------------- the run folder


def run_config(run_dir: Path) -> EchoConfig:
    from echo_rl.core.config import ConfigError, load_config

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
    from echo_rl.learner.checkpoint import kept_checkpoints

    return kept_checkpoints(run_dir)


def resolve_policy(run_dir: Path, which: str) -> Policy:
    """``which``: ``untrained``, ``latest``, ``best`` (the checkpoint the run's held-out
    evaluation scored highest, echo_rl/learner/heldout.py) or a step number."""
    if which == "untrained":
        return Policy("untrained", None)
    if which == "best":
        return _best(run_dir)
    from echo_rl.learner.checkpoint import steps_of

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
                steps = steps_of(path.name)
                return Policy(f"step {steps}", path, read_state(path), steps)
            except FileNotFoundError:
                continue
        raise EvalError(f"{ckpt}: the latest checkpoint kept changing while being read; try again")
    try:
        step = int(which)
    except ValueError:
        raise EvalError(
            f"checkpoint {which!r}: give a step number, latest, best or untrained"
        ) from None
    from echo_rl.learner.checkpoint import checkpoint_name

    path = files.get(step, ckpt / checkpoint_name(step))
    try:
        return Policy(f"step {step}", path, read_state(path), step)
    except FileNotFoundError:
        raise EvalError(
            f"{run_dir} has no checkpoint of step {step} ({path}); the learner keeps "
            f"the newest two, here steps: {kept}. Pass one of them, or leave "
            f"--checkpoint out for the latest, or --untrained"
        ) from None


def _best(run_dir: Path) -> Policy:
    from echo_rl.learner.checkpoint import best_checkpoint

    found = best_checkpoint(run_dir)
    if found is None:
        raise EvalError(
            f"{run_dir} has no best checkpoint (checkpoints/best.pt and best.json): the run "
            f"evaluated no held-out split while it ran (learner.heldout.every = 0, or an "
            f"adapter without a held-out split) or no evaluation finished yet; pass latest or "
            f"a step number"
        )
    path, info = found
    try:
        return Policy(f"best (step {info.steps})", path, read_state(path), info.steps)
    except FileNotFoundError:  # replaced by a better one between the two reads
        return _best(run_dir)


# ----------------------------------------------------------------- prompts


def eval_prompts(
    adapter: Adapter, split: str, n: int, seed: int, name: str = ""
) -> tuple[list[Prompt], str]:
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


def take(it: Iterable[_T], n: int) -> list[_T]:
    """The first ``n`` items of ``it`` (shared with ``echo-rl sample``)."""
    out: list[_T] = []
    for p in it:
        out.append(p)
        if len(out) == n:
            break
    return out


# ----------------------------------------------------------------- the policy


def load_backend(cfg: EchoConfig, threads: int) -> TransformersBackend:
    """The worker's default backend (the engine) for the run's model (base + adapter for
    LoRA)."""
    from echo_rl.worker.backends import make_backend

    lora = cfg.learner.lora if cfg.learner.lora.enabled else None
    extra = {"lora": lora} if lora is not None else {}
    from echo_rl.worker.backends.transformers import TransformersBackend

    backend = make_backend(
        "engine", model_cfg=cfg.model, threads=threads, device=cfg.worker.device, **extra
    )
    assert isinstance(backend, TransformersBackend)  # the engine holds a transformers model
    return backend


def install_policy(backend: TransformersBackend, policy: Policy, initial: ModelState) -> None:
    """Load ``policy``'s weights into ``backend.model``: a checkpoint's, or ``initial`` (the
    weights as loaded, the untrained model). A LoRA checkpoint holds the adapter alone."""
    from echo_rl.core.lora import adapter_parameters, is_peft

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
    else:
        missing, unexpected = _load(model, sd, policy)
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise EvalError(
                f"{policy.path}: the checkpoint does not fit the run's model (missing "
                f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}); "
                f"was config.toml edited after the run?"
            )
    if policy.sampled is not None:
        _as_published(model, policy.sampled)


def _as_published(model: torch.nn.Module, how: Sampled) -> None:
    """The model's weights through the learner's own publication and the worker's install:
    the same tensors in the same order (so the same rounding streams), the same cast."""
    from echo_rl.core.lora import adapter_parameters, is_peft
    from echo_rl.core.models import install_payload, params_to_payload

    named = list(adapter_parameters(model).items() if is_peft(model) else model.named_parameters())
    index, payload = params_to_payload(named, how.dtype, how.seed)
    install_payload(model, index, payload)


def _load(model: torch.nn.Module, sd: ModelState, policy: Policy) -> tuple[list[str], list[str]]:
    """``sd`` loaded into ``model``: the names it lacked and the names the model lacks."""
    try:
        keys: tuple[list[str], list[str]] = model.load_state_dict(sd, strict=False)
    except RuntimeError as exc:  # shapes: another model size or LoRA rank
        first = str(exc).strip().splitlines()[-1].strip()
        raise EvalError(
            f"{policy.path}: the checkpoint does not fit the run's model ({first}); "
            f"was config.toml edited after the run?"
        ) from None
    return keys


def score(
    backend: Backend,
    adapter: Adapter,
    prompts: list[Prompt],
    samples: int,
    max_new: int,
    temperature: float,
    seed: int,
) -> list[float]:
    """Each prompt's mean reward over ``samples`` completions. Group seeds depend only on
    ``seed`` and the prompt's index, and batches are the same every call: two policies are
    sampled with the same random numbers."""
    groups = seeded_groups(prompts, samples, seed, "eval")
    out: list[float] = []
    for i in range(0, len(groups), BATCH):
        batch = groups[i : i + BATCH]
        for rewards in _rewards(backend, adapter, batch, max_new, temperature):
            out.append(sum(rewards) / len(rewards))
    return out


def seeded_groups(prompts: list[Prompt], samples: int, seed: int, prefix: str) -> list[wire.Group]:
    """One group of ``samples`` per prompt, its sampling seed from ``seed`` and the prompt's
    index alone (``echo-rl eval`` and ``echo-rl sample`` draw the same numbers for a seed)."""
    from echo_rl.core import wire
    from echo_rl.data.rules import derived_seed

    return [
        wire.Group(
            group_id=f"{prefix}-{i}",
            prompt_ids=p.prompt_ids,
            n=samples,
            seed=derived_seed(seed, i),
            task=p.task,
        )
        for i, p in enumerate(prompts)
    ]


def _rewards(
    backend: Backend, adapter: Adapter, groups: list[wire.Group], max_new: int, temperature: float
) -> list[list[float]]:
    from echo_rl.data.episodes import EpisodeAdapter, backend_generate_fn

    if isinstance(adapter, EpisodeAdapter):
        gen = backend_generate_fn(backend, max_new, temperature, groups[0].seed)
        return [[float(ep.reward) for ep in eps] for eps in adapter.rollout(groups, gen)]
    tok = backend.tokenizer
    out = backend.generate(groups, max_new, temperature)
    return [
        [
            float(
                adapter.reward(
                    g.task,
                    s.completion_ids,
                    str(tok.decode(s.completion_ids, skip_special_tokens=True)),
                )
            )
            for s in samples
        ]
        for g, samples in zip(groups, out)
    ]


# ----------------------------------------------------------------- a scorer


class HeldoutScoreJson(TypedDict):
    """A ``HeldoutScore`` as the evaluator says it and checkpoints/best.json holds it."""

    steps: int
    mean: float
    lo: float
    hi: float
    prompts: int
    samples: int
    per_prompt: list[float]
    wall_s: NotRequired[float]  # absent from scores written before it was kept


@dataclass(frozen=True)
class HeldoutScore:
    """One policy's score on a split: the mean over prompts of each prompt's mean reward, its
    95 % t interval (echo_rl/core/ci.py), and the per-prompt means the next score pairs with. What the
    learner's evaluator reports for a checkpoint and checkpoints/best.json holds."""

    steps: int  # learner steps the scored checkpoint had taken
    mean: float
    lo: float
    hi: float
    prompts: int
    samples: int
    per_prompt: tuple[float, ...]
    wall_s: float = 0.0  # seconds the scoring took

    def to_json(self) -> HeldoutScoreJson:
        return {
            "steps": self.steps,
            "mean": round(self.mean, 6),
            "lo": round(self.lo, 6),
            "hi": round(self.hi, 6),
            "prompts": self.prompts,
            "samples": self.samples,
            "per_prompt": [round(x, 6) for x in self.per_prompt],
            "wall_s": round(self.wall_s, 3),
        }

    @classmethod
    def from_json(cls, doc: HeldoutScoreJson) -> HeldoutScore:
        return cls(
            steps=int(doc["steps"]),
            mean=float(doc["mean"]),
            lo=float(doc["lo"]),
            hi=float(doc["hi"]),
            prompts=int(doc["prompts"]),
            samples=int(doc["samples"]),
            per_prompt=tuple(float(x) for x in doc["per_prompt"]),
            wall_s=float(doc.get("wall_s", 0.0)),
        )


class Scorer:
    """A run's model in the worker's engine, its adapter, and the prompts of ``split`` drawn
    once: ``score(policy)`` samples every prompt ``samples`` times with the same seeds each
    call, so two policies' scores pair prompt by prompt."""

    def __init__(
        self,
        cfg: EchoConfig,
        *,
        split: str,
        n: int,
        samples: int,
        seed: int,
        threads: int,
        temperature: float | None = None,
        keep_initial: bool = False,
    ):
        from echo_rl.data.adapter import load_adapter
        from echo_rl.data.answers import check_answer_tokens

        self.backend = load_backend(cfg, threads)
        self.adapter = load_adapter(
            cfg.adapter.name, cfg.adapter.effective_options, self.backend.tokenizer
        )
        self.max_new = cfg.worker.max_new_tokens
        self.backend.restrict_answers(
            check_answer_tokens(
                self.adapter.answer_tokens,
                self.backend.vocab_size,
                self.max_new,
                self.backend.tokenizer.eos_token_id,
            )
        )
        self.temperature = cfg.worker.temperature if temperature is None else temperature
        self.samples, self.seed = samples, seed
        try:
            self.prompts, self.split = eval_prompts(self.adapter, split, n, seed, cfg.adapter.name)
        except BaseException:
            self.close()
            raise
        # the weights as loaded: what an ``untrained`` policy installs
        self.initial = (
            {k: v.detach().clone() for k, v in self.backend.model.state_dict().items()}
            if keep_initial
            else {}
        )

    def score(self, policy: Policy) -> list[float]:
        install_policy(self.backend, policy, self.initial)
        return score(
            self.backend,
            self.adapter,
            self.prompts,
            self.samples,
            self.max_new,
            self.temperature,
            self.seed,
        )

    def close(self) -> None:
        close = getattr(self.adapter, "close", None)
        if callable(close):
            close()
