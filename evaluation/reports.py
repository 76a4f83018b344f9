"""Figures and tables of the long-context results: needle accuracy and held-out loss by position.

One evaluation run (scripts/eval_needles.py, scripts/eval_perplexity.py) draws its own rows; the
collector (scripts/collect_long_context.py) draws the rows of several runs (seeds) together, each
cell the mean over the seeds and trials it holds, so both figures read the same way.
"""

import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def write_results(json_path, results, draw, title):
    """results (a dict) -> json_path, and draw(results["trials"] or results["rows"], title, png) -> the
    same path with .png; says where both went."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    draw(results.get("trials", results["rows"]), title, json_path.with_suffix(".png"))
    print(f"wrote {json_path} and {json_path.with_suffix('.png')}")


def length_label(length):
    if length >= 1 << 20:
        return f"{length >> 20}M"
    return f"{length // 1024}k" if length >= 1024 else str(length)


def plot_needles(trial_rows, title, png_path):
    """Accuracy by depth (rows) and length (columns), one heatmap per task, language, retrieval and
    selection; a cell is the mean of the trials (of every seed) at that length and depth."""
    panel_of = lambda t: (t["task"], t["lang"], t["retrieval"], t.get("selection"))  # noqa: E731
    panels = list(dict.fromkeys(panel_of(t) for t in trial_rows))
    lengths = sorted({t["length"] for t in trial_rows})
    depths = sorted({round(t["depth"], 4) for t in trial_rows})
    columns = min(len(panels), 4)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.0 * rows), squeeze=False, layout="constrained")
    for index, (ax, panel) in enumerate(zip(axes.flat, panels)):
        cells = defaultdict(list)
        for t in trial_rows:
            if panel_of(t) == panel:
                cells[depths.index(round(t["depth"], 4)), lengths.index(t["length"])].append(float(t["correct"]))
        grid = np.full((len(depths), len(lengths)), np.nan)
        for (row, column), values in cells.items():
            grid[row, column] = np.mean(values)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), [length_label(length) for length in lengths])
        ax.set_yticks(range(len(depths)), [f"{depth:.2f}" for depth in depths])
        task, lang, retrieval, selection = panel
        ax.set_title(", ".join([task, lang, retrieval or "dense"] + ([selection] if selection else [])), fontsize=9)
        if index // columns == rows - 1:
            ax.set_xlabel("prompt length (tokens)", fontsize=8)
        if index % columns == 0:
            ax.set_ylabel("needle depth", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, label="accuracy", shrink=0.8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def loss_spread(rows):
    """rows (model, seed, variant, text, bucket, loss, tokens) -> {(variant, text, bucket): (mean,
    min, max, seeds)} of the per-seed losses, in the rows' order."""
    losses = defaultdict(list)
    for row in rows:
        losses[row["variant"], row["text"], row["bucket"]].append(row["loss"])
    return {key: (float(np.mean(values)), min(values), max(values), len(values)) for key, values in losses.items()}


def plot_losses(rows, title, png_path):
    """Held-out loss by position bucket, one line per variant (the mean over seeds, bars from the
    lowest to the highest seed), one panel per text."""
    spread = loss_spread(rows)
    texts = list(dict.fromkeys(row["text"] for row in rows))
    buckets = list(dict.fromkeys(row["bucket"] for row in rows))
    fig, axes = plt.subplots(1, len(texts), figsize=(4.2 * len(texts), 3.6), squeeze=False)
    for ax, text in zip(axes[0], texts):
        for variant in dict.fromkeys(row["variant"] for row in rows):
            cells = [(buckets.index(b), spread[v, t, b]) for (v, t, b) in spread if v == variant and t == text]
            if not cells:
                continue
            x = [index for index, _ in cells]
            mean = np.array([cell[0] for _, cell in cells])
            low, high = mean - [cell[1] for _, cell in cells], [cell[2] for _, cell in cells] - mean
            ax.errorbar(x, mean, yerr=[low, high], marker="o", capsize=3, label=variant)
        ax.set_xticks(range(len(buckets)), buckets, rotation=30)
        ax.set_xlabel("tokens before the predicted one")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.set_title(text, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def plot_repeats(rows, title, png_path):
    """scripts/probe_repeats.py's rows: NLL of the first and the repeated readings by passage length,
    one panel per language."""
    langs = list(dict.fromkeys(row["lang"] for row in rows))
    fig, axes = plt.subplots(1, len(langs), figsize=(4.2 * len(langs), 3.4), squeeze=False)
    for ax, lang in zip(axes[0], langs):
        own = [row for row in rows if row["lang"] == lang]
        x = np.arange(len(own))
        ax.bar(x - 0.2, [row["first_nll"] for row in own], 0.4, label="first reading")
        ax.bar(x + 0.2, [row["repeated_nll"] for row in own], 0.4, label="repeated")
        ax.set_xticks(x, [f"{row['passage_tokens']} ({row['copy_from']})" for row in own])
        ax.set_xlabel("passage tokens (where the copy lies)")
        ax.set_ylabel("NLL (nats/token)")
        ax.set_title(lang, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def plot_induction(rows, title, png_path):
    """scripts/probe_induction.py's rows: NLL of the first and the repeated readings by training step."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    steps = [row["step"] for row in rows]
    ax.plot(steps, [row["first_nll"] for row in rows], marker=".", label="first reading")
    ax.plot(steps, [row["repeated_nll"] for row in rows], marker=".", label="repeated readings")
    ax.set_xlabel("training step")
    ax.set_ylabel("NLL (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def plot_selection(rows, title, png_path):
    """scripts/probe_selection.py's rows: share of queries with the needle's block in the top_n by
    length, one panel per layer, a line per ranking (hnsw_keys when probed) and language; rows of
    --answer go to plot_answer_selection."""
    if rows and "answer_token" in rows[0]:
        plot_answer_selection(rows, title, png_path)
        return

    def draw(ax, layer):
        for lang in dict.fromkeys(row["lang"] for row in rows):
            own = sorted((row for row in rows if row["layer"] == layer and row["lang"] == lang), key=lambda r: r["length"])
            for ranking, style in (("summary", "-"), ("max_logit", "--"), ("mass", ":"), ("hnsw_keys", "-.")):
                if f"{ranking}_in_top_n" not in own[0]:
                    continue
                ax.plot([length_label(row["length"]) for row in own], [row[f"{ranking}_in_top_n"] for row in own],
                        style, marker=".", label=f"{lang} {ranking}")
        ax.set_xlabel("prompt tokens")

    layer_panels(rows, draw, "needle block in top n", title, png_path)


def plot_answer_selection(rows, title, png_path):
    """probe_selection.py --answer rows: per answer token (in answer order), the share of (prompt, kv
    head) pairs with the copied block in the top_n by best key (dashed) and the mean probability of
    the right token (solid); one panel per layer, a pair of lines per language and length."""

    def draw(ax, layer):
        for lang, length in dict.fromkeys((row["lang"], row["length"]) for row in rows):
            own = [row for row in rows if (row["layer"], row["lang"], row["length"]) == (layer, lang, length)]
            labels = [row["answer_token"] for row in own]
            line = ax.plot(labels, [row["p_correct"] for row in own], "-", marker=".",
                           label=f"{lang} {length_label(length)} p(right token)")[0]
            ax.plot(labels, [row["max_logit_in_top_n"] for row in own], "--", marker=".", color=line.get_color(),
                    label=f"{lang} {length_label(length)} block in top n")
        ax.set_xlabel("answer token")
        ax.tick_params(axis="x", labelsize=7)

    layer_panels(rows, draw, "share / probability", title, png_path)


def layer_panels(rows, draw, ylabel, title, png_path):
    """One panel per layer of the probe's rows, draw(ax, layer) filling each, shares on 0..1."""
    layers = sorted({row["layer"] for row in rows})
    fig, axes = plt.subplots(1, len(layers), figsize=(3.6 * len(layers), 3.2), squeeze=False, sharey=True)
    for ax, layer in zip(axes[0], layers):
        draw(ax, layer)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
