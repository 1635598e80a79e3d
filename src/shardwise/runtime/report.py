"""`shardwise report RUN_DIR`: a run's metrics.jsonl as one PNG (loss, tokens/s, MFU, memory per
process, over optimizer steps) and a printed summary. Needs matplotlib (`shardwise[plot]`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..config.tree import ConfigError


def read_records(run_dir: Path, skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """The engine's records (lines with tokens_per_s or step_time_s) of a run's metrics.jsonl.

    A last line cut short (the run died while writing it) is left out, and one line saying so
    is appended to `skipped`; a damaged line anywhere else is an error."""
    path = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl here; pass the run folder a log_with='jsonl' run wrote "
                          "(<project_dir>/logs/<run name>)")
    records = []
    lines = path.read_bytes().splitlines()
    last = max((n for n, raw in enumerate(lines, 1) if raw.strip()), default=0)
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if n != last:
                why = e.msg if isinstance(e, json.JSONDecodeError) else e.reason
                raise ConfigError(f"{path}:{n}: not a JSON line ({why}); "
                                  "the file is damaged") from None
            if skipped is not None:  # written whole per line: only a crash mid-write leaves this
                skipped.append(f"skipped {path}:{n}: {len(raw)} bytes of an unfinished last line "
                               "(the run stopped while writing it)")
            continue
        if "step_time_s" in rec:
            records.append(rec)
    if not records:
        raise ConfigError(f"{path}: no metrics records (the engine writes one every log_every_steps steps)")
    # the file is appended to: a resumed run repeats steps after its checkpoint, a new run in the
    # same folder starts again at the beginning. The latest record of each step wins, and steps
    # past the last record belong to an earlier, longer run.
    by_step = {r["step"]: r for r in records}
    last = records[-1]["step"]
    return [by_step[s] for s in sorted(by_step) if s <= last]


def summary(records: list[dict[str, Any]]) -> str:
    steps = records[-1]["step"]
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    tps = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    sps = [r["samples_per_s"] for r in records if r.get("samples_per_s")]
    mfu = [r["mfu"] for r in records if r.get("mfu") is not None]
    peak = max((m["peak"] for r in records for m in r.get("memory", [])), default=0)
    lines = [f"{steps} steps, {len(records)} records"]
    if losses:
        lines.append(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (min {min(losses):.4f})")
    if tps:
        lines.append(f"tokens/s median {statistics.median(tps):,.0f}")
    elif sps:
        lines.append(f"samples/s median {statistics.median(sps):,.1f}")
    lines.append(f"step time median {statistics.median(r['step_time_s'] for r in records):.3f} s")
    if mfu:
        lines.append(f"MFU median {100 * statistics.median(mfu):.1f}%")
    if peak:
        lines.append(f"peak memory of a process {peak / 2**30:.2f} GiB")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("shardwise report draws with matplotlib: pip install 'shardwise[plot]'") from e
    steps = [r["step"] for r in records]
    moe = any(r.get("tokens_per_expert") for r in records)
    fig, axes = plt.subplots(3 if moe else 2, 2, figsize=(11, 10.5 if moe else 7))
    panels = [("loss", "loss", 1.0), ("tokens_per_s", "tokens/s", 1.0), ("mfu", "MFU (%)", 100.0)]
    for ax, (key, title, scale) in zip(axes.flat, panels):
        pts = [(s, r[key] * scale) for s, r in zip(steps, records) if r.get(key) is not None]
        if key == "tokens_per_s" and not pts:
            key, title = "samples_per_s", "samples/s"
            pts = [(s, r[key]) for s, r in zip(steps, records) if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 50 else None)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    ax = axes.flat[3]
    ranks = sorted({m["rank"] for r in records for m in r.get("memory", [])})
    for rank in ranks:
        rows = [(s, m) for s, r in zip(steps, records) for m in r.get("memory", []) if m["rank"] == rank]
        xs = [s for s, _ in rows]
        ax.plot(xs, [m["peak"] / 2**20 for _, m in rows], label=f"rank {rank} peak")
        ax.plot(xs, [(m["params"] + m["grads"] + m["optimizer"]) / 2**20 for _, m in rows], "--",
                label=f"rank {rank} tensors")
    ax.set_title("memory per process (MiB)")
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    if ranks:
        ax.legend(fontsize=7)
    if moe:
        _expert_load(axes.flat[4], axes.flat[5], steps, records)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _expert_load(lines: Any, last: Any, steps: list[int], records: list[dict[str, Any]]) -> None:
    """Expert parallelism's records: token slots per expert per step (summed over the MoE
    layers) over the run, and the last record's per layer (an idle or flooded expert shows)."""
    rows = [(s, r["tokens_per_expert"]) for s, r in zip(steps, records) if r.get("tokens_per_expert")]
    experts = len(rows[0][1][0])
    for e in range(experts):
        per_step = [sum(layer[e] for layer in load) for _, load in rows]
        lines.plot([s for s, _ in rows], per_step, label=f"expert {e}")
    lines.set_title("tokens per expert per step (all MoE layers)")
    lines.set_xlabel("optimizer step")
    lines.grid(alpha=0.3)
    lines.legend(fontsize=7)
    image = last.imshow(rows[-1][1], aspect="auto", cmap="viridis")
    last.set_title(f"tokens per expert per step at step {rows[-1][0]}")
    last.set_xlabel("expert")
    last.set_ylabel("MoE layer")
    last.figure.colorbar(image, ax=last)


def report(run_dir: Path) -> tuple[Path, str]:
    """The PNG written, and the summary (after a line naming anything left out of it)."""
    skipped: list[str] = []
    records = read_records(run_dir, skipped)
    folder = run_dir if run_dir.is_dir() else run_dir.parent
    return plot(records, folder / "report.png"), "\n".join([*skipped, summary(records)])
