"""What a GPU machine needs carried to it (it reaches no package index): ``make gpu-wheels``
and ``make gpu-weights``.

    python benchmarks/gpu_carry.py wheels   # .whl/: the wheels Echo needs there, pinned, size-checked
    python benchmarks/gpu_carry.py weights  # .gpu/: SmolLM2's GGUF in parts, one per call

The machine (see docs/gpu.md) has torch, transformers, peft, numpy, msgpack, rich, scipy,
pandas, pyarrow, matplotlib, prometheus-client, sympy, pyyaml, requests, tqdm, pytest; not the
packages below. A call carries the working tree and these folders, 64 MiB in all: the wheels
take about 11 MiB and the tree about 9 (and growing), so the 94 MiB GGUF travels in parts, one
per call, each sized from the tree as it is when they are cut, and ``benchmarks/gpu_suite.py``
joins them on the machine (files outside the checkout survive between calls while the machine
stays up, which is 30 s idle: have the calls ready to send back to back).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Python 3.12 manylinux x86-64 builds of what the machine lacks, at the versions this checkout
# is tested with (pyproject.toml's ranges), their own needs included (at versions those need:
# pydantic 2.14 wants typing-inspection >= 0.4.4, which the first GPU run found the hard way).
PINS = [
    "pyzmq==27.3.0",
    "lz4==4.4.5",
    "blake3==1.0.11",
    "cryptography==50.0.2",
    "cffi==2.0.0",
    "pycparser==2.23",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "annotated-types==0.7.0",
    "typing-inspection==0.4.5",
    "math-verify==0.9.0",
    "latex2sympy2_extended==1.11.0",
    "antlr4-python3-runtime==4.13.2",
    "gguf==0.19.0",
    "simpy==4.1.2",
    "pokerkit==0.7.7",
]
PLATFORMS = [
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux1_x86_64",
]
CALL_MIB = 64
WHEELS_MIB = 16  # what the wheels may take of a call, leaving the rest to the tree and a GGUF part
# Below the limit for what the device counts beyond the files' bytes: on 2026-11-27 a call of
# 63.6 MiB by this count was refused and one of 62.8 went; and for files the tree gains between
# this split and the call.
MARGIN_MIB = 2.5
GGUF = ROOT / "models" / ".cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def wheels(dest: Path) -> int:
    dest.mkdir(exist_ok=True)
    flags = [f"--platform={p}" for p in PLATFORMS]
    for pin in PINS:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *flags,
            "-d",
            str(dest),
            pin,
        ]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            print(f"{pin}: pip download failed: {run.stderr.strip()[-400:]}", file=sys.stderr)
            return 1

    def key(
        name: str,
    ) -> str:  # "typing_inspection-0.4.5-...whl" and "typing-inspection==0.4.5" alike
        pkg, ver = name.split("==") if "==" in name else name.split("-")[:2]
        return f"{pkg.lower().replace('_', '-')}=={ver}"

    pinned = {key(x) for x in PINS}
    for stale in [p for p in dest.glob("*.whl") if key(p.name) not in pinned]:
        stale.unlink()  # another version of a pin: two versions of one package stop the install
    names = {key(p.name) for p in dest.glob("*.whl")}
    total = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(
        f"{len(names)} wheels, {total / 2**20:.1f} MiB in {dest} (budget {WHEELS_MIB} MiB of a "
        f"{CALL_MIB} MiB call)"
    )
    if total > WHEELS_MIB * 2**20:
        print("over budget: drop a package from PINS or raise WHEELS_MIB", file=sys.stderr)
        return 1
    return 0


def travelling_mib() -> float:
    """What every call carries besides its named paths: the tracked and untracked-not-ignored
    files (the tree grows, so the parts are sized from it, not from a constant)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    files = [ROOT / f for f in out.decode().split("\0") if f]
    return sum(f.stat().st_size for f in files if f.is_file()) / 2**20


def part_bounds(total: int, tree_mib: float, wheels_mib: float) -> list[int]:
    """Cut points of the GGUF: part 0 fills what a call has left beside the tree and the wheels,
    each later part what is left beside the tree alone."""
    room = int((CALL_MIB - MARGIN_MIB - tree_mib) * 2**20)
    first = room - math.ceil(wheels_mib * 2**20)
    if first <= 0:
        raise SystemExit(
            f"the tree ({tree_mib:.1f} MiB) and the wheels ({wheels_mib:.1f} MiB) leave no room "
            f"in a {CALL_MIB} MiB call: ignore what the GPU run does not need"
        )
    bounds = [0, min(first, total)]
    while bounds[-1] < total:
        bounds.append(min(bounds[-1] + room, total))
    return bounds


def weights(dest: Path) -> int:
    """The GGUF in parts, each in its own folder ``dest/partN`` with the manifest, sized so
    that call N carries ``dest/partN`` (call 0 with ``.whl`` beside it) under the call limit."""
    if not GGUF.is_file():
        from echo_rl.core.gguf_import import fetch_smollm2

        fetch_smollm2(GGUF.parent)
    data = GGUF.read_bytes()
    whl = ROOT / ".whl"
    wheels_mib = (
        sum(f.stat().st_size for f in whl.glob("*.whl")) / 2**20 if whl.is_dir() else WHEELS_MIB
    )
    tree_mib = travelling_mib()
    bounds = part_bounds(len(data), tree_mib, wheels_mib)
    parts = len(bounds) - 1
    names = [f"{GGUF.name}.part{i}" for i in range(parts)]
    man = {"parts": names, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    shutil.rmtree(dest, ignore_errors=True)
    for i, name in enumerate(names):
        folder = dest / f"part{i}"
        folder.mkdir(parents=True)
        (folder / name).write_bytes(data[bounds[i] : bounds[i + 1]])
        (folder / "manifest.json").write_text(json.dumps(man, indent=2) + "\n")
    sizes = ", ".join(f"{(bounds[i + 1] - bounds[i]) / 2**20:.1f}" for i in range(parts))
    rel = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
    print(
        f"{GGUF.name}: {len(data) / 2**20:.1f} MiB in {parts} parts ({sizes} MiB) under {dest}, "
        f"sized for a {CALL_MIB} MiB call beside a {tree_mib:.1f} MiB tree; carry "
        + "; ".join(
            f"call {i + 1}: {'.whl, ' if i == 0 else ''}{rel}/part{i}" for i in range(parts)
        )
        + f"; the last call runs make gpu-check ARGS='--weights {rel}/part{parts - 1}'"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["wheels", "weights"])
    p.add_argument("--dest", type=Path)
    a = p.parse_args(argv)
    if a.what == "wheels":
        return wheels(a.dest or ROOT / ".whl")
    sys.path.insert(0, str(ROOT))
    return weights(a.dest or ROOT / ".gpu")


if __name__ == "__main__":
    sys.exit(main())
