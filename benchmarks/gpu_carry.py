"""What a GPU machine needs carried to it (it reaches no package index): ``make gpu-wheels``
and ``make gpu-weights``.

    python benchmarks/gpu_carry.py wheels   # .whl/: the wheels Echo needs there, pinned, size-checked
    python benchmarks/gpu_carry.py weights  # .gpu/: SmolLM2's GGUF in parts, one per call

The machine (see docs/gpu.md) has torch, transformers, peft, numpy, msgpack, rich, scipy,
pandas, pyarrow, matplotlib, prometheus-client, sympy, pyyaml, requests, tqdm, pytest; not the
packages below. A call carries the working tree and these folders, 64 MiB in all: the wheels
take about 12 MiB, so the 94 MiB GGUF travels in two parts, one per call, and
``benchmarks/gpu_suite.py`` joins them on the machine (files outside the checkout survive between
calls while the machine stays up).
"""

from __future__ import annotations

import argparse
import hashlib
import json
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


def weights(dest: Path, parts: int, first_mib: float = 0.0) -> int:
    """``parts`` pieces; with ``first_mib`` the first is that size (the call that also carries
    the wheels), the rest share the remainder."""
    if not GGUF.is_file():
        from echo.gguf_import import fetch_smollm2

        fetch_smollm2(GGUF.parent)
    data = GGUF.read_bytes()
    dest.mkdir(exist_ok=True)
    first = int(first_mib * 2**20) if first_mib else -(-len(data) // parts)
    rest = -(-(len(data) - first) // max(parts - 1, 1))
    bounds = [0, first] + [min(first + rest * k, len(data)) for k in range(1, parts)]
    names = []
    for i in range(parts):
        name = f"{GGUF.name}.part{i}"
        (dest / name).write_bytes(data[bounds[i] : bounds[i + 1]])
        names.append(name)
    man = {"parts": names, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (dest / "manifest.json").write_text(json.dumps(man, indent=2) + "\n")
    sizes = ", ".join(f"{(bounds[i + 1] - bounds[i]) / 2**20:.1f}" for i in range(parts))
    print(
        f"{GGUF.name}: {len(data) / 2**20:.1f} MiB in {parts} parts ({sizes} MiB) in {dest}; "
        f"carry one part per call (move the others out of {dest} for that call)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["wheels", "weights"])
    p.add_argument("--dest", type=Path)
    p.add_argument("--parts", type=int, default=2)
    p.add_argument(
        "--first-mib",
        type=float,
        default=44.0,
        help="size of part 0, carried with the wheels; later calls need not carry them again",
    )
    a = p.parse_args(argv)
    if a.what == "wheels":
        return wheels(a.dest or ROOT / ".whl")
    sys.path.insert(0, str(ROOT))
    return weights(a.dest or ROOT / ".gpu", a.parts, a.first_mib)


if __name__ == "__main__":
    sys.exit(main())
