"""PNG plots of a `bench.py` results dict (the JSON it writes with --json). Rendering only: no measuring.

* ``benchmarks-throughput.png``: tokens/s per configuration, one panel per section (decode: stock
  transformers vs ours per dtype, with the one-token roofline; assisted: ours alone vs each draft
  schedule; prompt lookup: ours alone vs with lookup, median over prompts).
* ``benchmarks-speedup-vs-k.png``: assisted generation, speedup over ours alone against the number of
  draft tokens per round k (constant schedule), with the acceptance rate; the heuristic schedule as a
  dashed line.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Dict, List, Optional

THROUGHPUT_PNG = "benchmarks-throughput.png"
SPEEDUP_PNG = "benchmarks-speedup-vs-k.png"

STOCK, OURS, SPEC = "#9e9e9e", "#1f77b4", "#ff7f0e"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe when a GUI backend was configured
    import matplotlib.pyplot as plt

    return plt


def draft_tokens(row: dict) -> Optional[int]:
    """k of an assisted row with the constant schedule (recorded as ``k``, or parsed from older configs)."""
    if row.get("schedule", "constant") != "constant":
        return None
    if row.get("k") is not None:
        return int(row["k"])
    match = re.search(r"k=(\d+) constant", row["config"])
    return int(match.group(1)) if match else None


def _bars(ax, labels, values, colors, title, ylabel="tokens/s"):
    bars = ax.bar(range(len(values)), values, color=colors)
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)


def plot_throughput(result: dict, path: Path) -> Optional[Path]:
    """Bar chart of tokens/s per configuration; None when the results hold no section."""
    panels = []
    if result.get("runs"):
        panels.append("decode")
    if result.get("assisted"):
        panels.append("assisted")
    if result.get("lookup"):
        panels.append("lookup")
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 4.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "decode":
            labels, values, colors = [], [], []
            bandwidth = result["environment"].get("bandwidth_gbs")
            for i, run in enumerate(result["runs"]):
                labels += [f"stock {run['dtype']}", f"ours {run['dtype']}"]
                values += [run["median_stock_tok_s"], run["median_ours_tok_s"]]
                colors += [STOCK, OURS]
                if bandwidth:
                    roof = bandwidth * 1e9 / run["weight_bytes"]
                    ax.hlines(roof, 2 * i - 0.4, 2 * i + 1.4, colors="k", linestyles=":", linewidth=1)
                    ax.annotate(f"roofline {roof:.0f}", (2 * i + 0.5, roof), ha="center", va="bottom", fontsize=7)
            _bars(ax, labels, values, colors, "Decode, one token per step\n(median decode tok/s)")
        elif panel == "assisted":
            rows = result["assisted"]
            labels = [r["config"].replace("ours fp32 + bf16 self-draft, ", "+ bf16 draft, ")
                      .replace(" fp32 alone", " fp32") for r in rows]
            colors = [STOCK if r["config"].startswith("stock") else OURS if "alone" in r["config"] else SPEC
                      for r in rows]
            _bars(ax, labels, [r["median_decode_tok_s"] for r in rows], colors,
                  "Assisted generation, fp32 target\n(median decode tok/s)")
        else:
            rows = result["lookup"]
            values = [statistics.median(r["alone_tok_s"] for r in rows),
                      statistics.median(r["lookup_tok_s"] for r in rows)]
            _bars(ax, ["ours fp32", f"+ lookup, k={result.get('lookup_tokens', '?')}"], values,
                  [OURS, SPEC], f"Prompt lookup, {len(rows)} grounded prompts\n(median end-to-end tok/s)")
    fig.suptitle(f"SmolLM2-135M-Instruct, {result['environment']['threads']} thread(s), "
                 f"{result['new_tokens']} new tokens, greedy", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_speedup_vs_k(result: dict, path: Path) -> Optional[Path]:
    """Speedup over ours alone against k; None without an assisted section with constant-k rows."""
    rows = [r for r in result.get("assisted") or [] if draft_tokens(r) is not None]
    if not rows:
        return None
    rows.sort(key=draft_tokens)
    ks = [draft_tokens(r) for r in rows]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(ks, [r["median_ratio_vs_ours_alone"] for r in rows], "o-", color=SPEC, label="decode speedup")
    ax.plot(ks, [r["median_end_to_end_ratio_vs_ours_alone"] for r in rows], "s--", color=OURS,
            label="end-to-end speedup (prefill included)")
    for r in result["assisted"]:
        if "heuristic" in r["config"]:
            ax.axhline(r["median_ratio_vs_ours_alone"], color=SPEC, linestyle=":", linewidth=1,
                       label=f"heuristic schedule, decode x{r['median_ratio_vs_ours_alone']:.2f}")
    ax.axhline(1.0, color="k", linewidth=0.8)
    for k, r in zip(ks, rows):
        if r.get("acceptance_rate") is not None:
            ax.annotate(f"{r['acceptance_rate']:.0%} accepted", (k, r["median_ratio_vs_ours_alone"]), fontsize=8,
                        xytext=(0, 8), textcoords="offset points", ha="center")
    ax.set_xticks(ks)
    ax.set_xlabel("draft tokens per round k (constant schedule)")
    ax.set_ylabel("speedup vs ours fp32 alone")
    top = max(max(r["median_ratio_vs_ours_alone"], r["median_end_to_end_ratio_vs_ours_alone"]) for r in rows)
    ax.set_ylim(0, max(top, 1.0) * 1.2)
    ax.set_xlim(min(ks) - 1.5, max(ks) + 1.5)
    ax.set_title("Assisted generation: fp32 target + bf16 self-draft", fontsize=11)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def render_plots(result: dict, folder: Path, stem: str = "benchmarks") -> Dict[str, Path]:
    """Write the plots that ``result`` has data for into ``folder`` (file names start with ``stem``, the
    markdown report's, e.g. ``benchmarks-throughput.png``); return {kind: path}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = {
        "throughput": plot_throughput(result, folder / THROUGHPUT_PNG.replace("benchmarks", stem, 1)),
        "speedup_vs_k": plot_speedup_vs_k(result, folder / SPEEDUP_PNG.replace("benchmarks", stem, 1)),
    }
    return {kind: p for kind, p in written.items() if p is not None}


def image_lines(plots: Dict[str, Path], kind: str, alt: str) -> List[str]:
    """Markdown lines embedding plot ``kind`` by file name (it sits next to the markdown), or nothing."""
    return ["", f"![{alt}]({plots[kind].name})"] if kind in plots else []
