"""``echo-rl report RUN_DIR [RUN_DIR ...] [--out DIR] [--target-reward X]``.

Reads each run's metrics.jsonl, decisions.jsonl, summary.json and config.toml and writes into
``--out`` (default ``report/``):

- ``index.html``: side-by-side summary table and plots (PNGs embedded, also saved alongside);
- ``steps.csv`` / ``steps.parquet``: every run's per-step rows (column ``run``), with the
  derived columns ``cost_usd_step`` (fleet ``cost_step_usd`` + ``learner.price_per_hour`` over
  ``t_train + t_wait``), ``cost_usd`` (cumulative) and ``reward_rolling``;
- ``summary.csv`` / ``summary.parquet``: one row per run;
- ``decisions.csv``: the provisioner's decisions of every run.

Cost to reach a target reward: the first step where the rolling mean (``--window`` steps,
default 5) of ``reward_mean`` reaches X; the cost is the cumulative cost up to and including
that step. Runs that never reach it show an empty cell.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from echo_rl.core.jsontypes import JsonObject
from echo_rl.core.metrics import _jsonl, learner_price_of
from echo_rl.core.steprow import COL

if TYPE_CHECKING:
    import pandas as pd

# A run's line in the summary table: name, counts, dollars, seconds (None: not measured).
SummaryRow = dict[str, str | float | None]

PLOTS = (  # file, y column, title, y label
    ("reward.png", "reward_rolling", "Reward (rolling mean of batch reward)", "reward"),
    ("cost.png", "cost_usd", "Cost so far", "$"),
    ("bubble.png", COL.bubble_ratio, "Bubble ratio (cumulative)", "B"),
    ("staleness.png", COL.staleness_mean, "Mean staleness of the batch", "versions"),
)


def load_run(
    run_dir: Path, window: int = 5
) -> tuple[pd.DataFrame, JsonObject, list[JsonObject], float]:
    """A run's step rows (with the derived cost and reward columns), its summary.json ({}
    if absent), its provisioner decisions and the learner's price per hour."""
    import pandas as pd

    rows = _jsonl(run_dir / "metrics.jsonl")
    if not rows:
        raise ValueError(f"{run_dir}: no metrics.jsonl rows")
    df = pd.DataFrame(rows)
    # Nested columns (rejected: {reason: n}) flatten into rejected_<reason>.
    if COL.rejected in df:
        rej = pd.json_normalize(df.pop(COL.rejected).apply(lambda x: x or {}).tolist())
        rej.columns = [f"rejected_{c}" for c in rej.columns]
        df = pd.concat([df, rej.fillna(0).astype("int64")], axis=1)
    for col in df.columns:
        if df[col].map(lambda x: isinstance(x, (dict, list))).any():
            df[col] = df[col].map(json.dumps)
    price = learner_price_of(run_dir)
    secs = df.get(COL.t_train, 0.0) + df.get(COL.t_wait, 0.0)
    df["learner_price_per_hour"] = price
    df["cost_usd_step"] = df.get(COL.cost_step_usd, 0.0) + price * secs / 3600.0
    df["cost_usd"] = df["cost_usd_step"].cumsum()
    df["reward_rolling"] = df[COL.reward_mean].rolling(window, min_periods=window).mean()
    summary_path = run_dir / "summary.json"
    summary: JsonObject = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    decisions = _jsonl(run_dir / "decisions.jsonl")
    return df, summary, decisions, price


def target_reached(df: pd.DataFrame, target: float | None) -> dict[str, float | None]:
    if target is None:
        return {}
    hit = df.index[df["reward_rolling"] >= target]
    if len(hit) == 0:
        return {"target_step": None, "cost_to_target_usd": None, "wall_to_target_s": None}
    i = hit[0]
    return {
        "target_step": int(df.at[i, COL.step]),
        "cost_to_target_usd": float(df.at[i, "cost_usd"]),
        "wall_to_target_s": float(df.at[i, COL.wall_s]) if COL.wall_s in df else None,
    }


def summarise(
    name: str,
    df: pd.DataFrame,
    summary: JsonObject,
    decisions: list[JsonObject],
    price: float,
    target: float | None,
) -> SummaryRow:
    last = df.iloc[-1]
    admitted = float(last.get(COL.admitted, 0) or 0)
    cost = float(last["cost_usd"])
    t_bcast = df[COL.t_bcast].dropna() if COL.t_bcast in df else None
    fleet_price = COL.fleet_price_per_hour
    out: SummaryRow = {
        "run": name,
        "steps": len(df),
        COL.wall_s: float(last[COL.wall_s]) if COL.wall_s in df else None,
        "reward_first10": float(df[COL.reward_mean].head(10).mean()),
        "reward_last10": float(df[COL.reward_mean].tail(10).mean()),
        COL.bubble_ratio: float(last.get(COL.bubble_ratio, float("nan"))),
        COL.staleness_max: int(df[COL.staleness_max].max()) if COL.staleness_max in df else None,
        "cost_usd": cost,
        "cost_per_step_usd": cost / len(df),
        "cost_per_1k_admitted_usd": 1000 * cost / admitted if admitted else None,
        COL.admitted: int(admitted),
        "learner_price_per_hour": price,
        "fleet_price_per_hour_mean": float(df[fleet_price].mean()) if fleet_price in df else None,
        "t_bcast_median_s": (
            float(t_bcast.median()) if t_bcast is not None and len(t_bcast) else None
        ),
        "learner_mib_sent": float(last.get(COL.learner_bytes_sent, 0)) / 2**20,
        "decisions": len(decisions),
        "activations": sum(d.get("action") == "activate" for d in decisions),
        "releases": sum(d.get("action") == "release" for d in decisions),
    }
    if target is not None:
        out.update(target_reached(df, target))
    return out


def _plot(frames: dict[str, pd.DataFrame], col: str, title: str, ylabel: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for name, df in frames.items():
        if col in df and df[col].notna().any():
            ax.plot(df[COL.step], df[col], label=name, linewidth=1.6)
    ax.set_title(title)
    ax.set_xlabel("learner step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if frames:
        ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _fmt(v: object) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return html.escape(str(v))


def _html(
    summaries: list[SummaryRow],
    images: dict[str, bytes],
    target: float | None,
    window: int,
    decisions: list[JsonObject],
) -> str:
    keys = [k for k in summaries[0] if k != "run"]
    head = "".join(f"<th>{html.escape(str(s['run']))}</th>" for s in summaries)
    body = "".join(
        f"<tr><th>{html.escape(k)}</th>"
        + "".join(
            f'<td id="{html.escape(str(s["run"]))}-{k}">{_fmt(s.get(k))}</td>' for s in summaries
        )
        + "</tr>"
        for k in keys
    )
    imgs = "".join(
        f'<figure><img alt="{n}" src="data:image/png;base64,{base64.b64encode(b).decode()}">'
        f"<figcaption>{n}</figcaption></figure>"
        for n, b in images.items()
    )
    dec = "".join(
        f"<tr><td>{html.escape(str(d.get('run')))}</td><td>{d.get('step')}</td>"
        f"<td>{html.escape(str(d.get('action')))}</td><td>{html.escape(str(d.get('worker') or '–'))}</td>"
        f"<td>{html.escape(str(d.get('reason', '')))}</td></tr>"
        for d in decisions[-30:]
    )
    tgt = (
        f"<p>Target reward {target} (rolling mean over {window} steps): <b>target_step</b> is the "
        f"first step reaching it, <b>cost_to_target_usd</b> the cumulative cost up to it.</p>"
        if target is not None
        else ""
    )
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Echo run report</title>
<style>body{{font:14px system-ui,sans-serif;margin:20px;color:#1d2330}}table{{border-collapse:collapse}}
th,td{{border-bottom:1px solid #ddd;padding:3px 10px;text-align:right;font-variant-numeric:tabular-nums}}
th:first-child{{text-align:left}}figure{{display:inline-block;margin:6px}}img{{max-width:640px}}
.dec td{{text-align:left;vertical-align:top;font-size:12px}}</style></head><body>
<h1>Echo run report</h1>
<p>Cost = fleet (sum of active workers' prices) + learner price, over t_train + t_wait of each step.
Files: steps.csv/.parquet, summary.csv/.parquet, decisions.csv, *.png.</p>{tgt}
<h2>Runs side by side</h2><table id="summary"><tr><th>metric</th>{head}</tr>{body}</table>
<h2>Plots</h2>{imgs}
<h2>Provisioner decisions (last 30)</h2><table class="dec"><tr><th>run</th><th>step</th><th>action</th>
<th>worker</th><th>reason</th></tr>{dec}</table></body></html>
"""


def make_report(
    run_dirs: list[Path], out: Path, target: float | None = None, window: int = 5
) -> dict[str, Path]:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    frames: dict[str, pd.DataFrame] = {}
    summaries: list[SummaryRow] = []
    all_decisions: list[JsonObject] = []
    for rd in run_dirs:
        base = name = rd.resolve().name
        n = 1
        while name in frames:
            n += 1
            name = f"{base}-{n}"
        df, summary, decisions, price = load_run(rd, window)
        df.insert(0, "run", name)
        frames[name] = df
        summaries.append(summarise(name, df, summary, decisions, price, target))
        all_decisions += [{"run": name, **d} for d in decisions]
    steps = pd.concat(frames.values(), ignore_index=True, sort=False)
    summ = pd.DataFrame(summaries)
    paths = {
        "html": out / "index.html",
        "steps_csv": out / "steps.csv",
        "steps_parquet": out / "steps.parquet",
        "summary_csv": out / "summary.csv",
        "summary_parquet": out / "summary.parquet",
        "decisions_csv": out / "decisions.csv",
    }
    steps.to_csv(paths["steps_csv"], index=False)
    steps.to_parquet(paths["steps_parquet"], index=False)
    summ.to_csv(paths["summary_csv"], index=False)
    summ.to_parquet(paths["summary_parquet"], index=False)
    pd.DataFrame(
        all_decisions,
        columns=["run", "step", "action", "worker", "reason", "c_eff", "target", "mu_req"],
    ).to_csv(paths["decisions_csv"], index=False)
    images: dict[str, bytes] = {}
    for fname, col, title, ylabel in PLOTS:
        png = _plot(frames, col, title, ylabel)
        (out / fname).write_bytes(png)
        images[fname] = png
        paths[fname] = out / fname
    paths["html"].write_text(_html(summaries, images, target, window, all_decisions))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="echo-rl report", description="compare runs: HTML, CSV, Parquet"
    )
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", type=Path, default=Path("report"))
    p.add_argument("--target-reward", type=float, default=None)
    p.add_argument("--window", type=int, default=5, help="rolling window for the target (steps)")
    args = p.parse_args(argv)
    from echo_rl.core.extras import require

    for module in ("pandas", "pyarrow", "matplotlib"):  # before any work: the extra to install
        require(module, "echo-rl report")
    missing = [str(d) for d in args.run_dirs if not (d / "metrics.jsonl").exists()]
    if missing:
        print(f"echo-rl report: no metrics.jsonl in {', '.join(missing)}", file=sys.stderr)
        return 2
    paths = make_report(args.run_dirs, args.out, args.target_reward, args.window)
    print(f"report: {paths['html']}  (tables: {args.out}/steps.csv|.parquet, summary.csv|.parquet)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
