"""Draw which keys each query of ANN attention sees (docs/ann_pattern.png).

The mask comes from the code the model runs (model/ann_attention.py, masked SDPA path): block
summaries (--summary, default the model's: bounds) -> candidate counts -> exact top-n selection ->
`far_mask` | `window_band`, for one kv head. The keys
are synthetic but structured: the sequence is a run of "topics" two blocks long, each key is its
topic's direction plus noise and each query points along its own topic, so retrieval should pick
earlier blocks of the same topic (random keys would give a pattern with nothing to read in it).

Left: the whole (query x key) mask. Right: one query row taken apart: the window, the candidate
blocks with their scores, the top-n picked, and the block that straddles the window's edge, whose
in-window keys belong to the window and are counted once.

    python scripts/plot_ann_pattern.py --out docs/ann_pattern.png
"""

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from model.ann_attention import far_mask, window_band
from model.config import BLOCK_SUMMARIES, MiniMindConfig
from model.retrieval import block_summaries, candidate_count, exact_select, selection_queries

FUTURE, SKIPPED, WINDOW, RETRIEVED = range(4)
CATEGORY_COLOURS = ["#ffffff", "#e4e4e4", "#4c78a8", "#f58518"]
CATEGORY_NAMES = ["future (causal)", "earlier, not selected", "window", "retrieved block"]
TOPIC_COLOURS = ["#54a24b", "#b279a2", "#e45756", "#72b7b2"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/ann_pattern.png")
    p.add_argument("--length", type=int, default=160)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--block_size", type=int, default=8)
    p.add_argument("--top_n", type=int, default=3)
    p.add_argument("--topics", type=int, default=3)
    p.add_argument("--head_dim", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--summary", choices=BLOCK_SUMMARIES, default=MiniMindConfig().ann_block_summary)
    args = p.parse_args(argv)
    if args.window % args.block_size or args.length < args.window + 2 * args.block_size:
        p.error("window must be a multiple of block_size, and length at least window + 2 blocks")
    return args


def topic_sequence(args, generator):
    """Keys and queries (1, 1, L, d) of one kv head, and the topic of every position (L,)."""
    segment = 2 * args.block_size
    segments = -(-args.length // segment)
    # Each segment moves to a different topic, so every topic recurs at several distances.
    steps = torch.randint(1, args.topics, (segments,), generator=generator)
    topic_of_segment = steps.cumsum(0) % args.topics
    topics = topic_of_segment.repeat_interleave(segment)[: args.length]
    directions = torch.nn.functional.normalize(torch.randn(args.topics, args.head_dim, generator=generator), dim=-1)
    keys = 2.0 * directions[topics] + 0.6 * torch.randn(args.length, args.head_dim, generator=generator)
    queries = 2.0 * directions[topics] + 0.25 * torch.randn(args.length, args.head_dim, generator=generator)
    return keys[None, None], queries[None, None], topics


def ann_selection(keys, queries, window, block_size, top_n, summary):
    """The steps of AnnAttention.masked_sdpa up to its mask, for one sequence and one kv head.

    -> mask (L, L), block scores (L, m), block ids and valid (L, n), candidate counts (L,).
    """
    length = keys.shape[2]
    summaries = block_summaries(keys, 0, length // block_size, block_size, summary)
    group_queries = selection_queries(queries, 1, summary)
    limits = candidate_count(torch.arange(length)[None], window, block_size)
    block_ids, valid = exact_select(group_queries, summaries, limits, top_n)
    mask = far_mask(block_ids, valid, length, window, block_size) | window_band(length, 0, 0, length, window, keys.device)
    scores = (group_queries @ summaries.transpose(-1, -2))[0, 0]
    return mask[0, 0], scores, block_ids[0, 0], valid[0, 0], limits[0]


def key_categories(mask, window):
    """Colour index of every (query, key): the window band, retrieved keys, skipped past, future."""
    length = mask.shape[0]
    offset = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    categories = torch.full((length, length), FUTURE)
    categories[offset <= 0] = SKIPPED
    categories[mask & (offset <= -window)] = RETRIEVED
    categories[(offset <= 0) & (offset > -window)] = WINDOW
    return categories


def explained_query(block_ids, valid, window, block_size):
    """The last query whose straddling block (holding both t-W and t-W+1) is retrieved: the case
    where the window and a block share keys. Falls back to the last query."""
    length = block_ids.shape[0]
    for t in range(length - 1, window, -1):
        straddling = (t - window) // block_size
        if (t - window + 1) % block_size and straddling in block_ids[t][valid[t]].tolist():
            return t
    return length - 1


def topic_strip(ax, topics, horizontal):
    image = topics[None, :] if horizontal else topics[:, None]
    ax.imshow(image, aspect="auto", cmap=ListedColormap(TOPIC_COLOURS[: int(topics.max()) + 1]), interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def draw(args, mask, scores, block_ids, valid, limits, topics):
    # matplotlib wants numpy arrays; torch tensors work but warn.
    categories, scores, topics = key_categories(mask, args.window).numpy(), scores.numpy(), topics.numpy()
    t = explained_query(block_ids, valid, args.window, args.block_size)
    chosen = sorted(block_ids[t][valid[t]].tolist())
    num_blocks = scores.shape[1]
    cmap = ListedColormap(CATEGORY_COLOURS)

    fig = plt.figure(figsize=(11.5, 5.4))
    grid = fig.add_gridspec(
        2, 3, width_ratios=[0.04, 1.0, 1.25], height_ratios=[0.04, 1.0], wspace=0.08, hspace=0.03, left=0.05, right=0.98
    )
    ax_mask = fig.add_subplot(grid[1, 1])
    ax_mask.imshow(categories, cmap=cmap, vmin=0, vmax=3, interpolation="nearest")
    ax_mask.axhline(t, color="black", lw=0.8, ls="--")
    ax_mask.set_xlabel("key position")
    ax_mask.set_yticks([])
    ax_mask.set_title(
        f"mask from far_mask | window_band: L={args.length}, W={args.window}, B={args.block_size}, top_n={args.top_n}",
        fontsize=9, pad=18,
    )
    ax_mask.set_xticks(range(0, args.length, 32))
    topic_strip(fig.add_subplot(grid[0, 1]), topics, horizontal=True)
    ax_topics_q = fig.add_subplot(grid[1, 0])
    topic_strip(ax_topics_q, topics, horizontal=False)
    ax_topics_q.set_ylabel("query position (strips: topic of each position)")
    ax_topics_q.set_yticks(range(0, args.length, 32))

    right = grid[:, 2].subgridspec(2, 1, height_ratios=[0.3, 1.0], hspace=0.55)
    ax_row = fig.add_subplot(right[0])
    ax_row.imshow(categories[t][None, :], cmap=cmap, vmin=0, vmax=3, aspect="auto", interpolation="nearest")
    for boundary in range(0, args.length + 1, args.block_size):
        ax_row.axvline(boundary - 0.5, color="black", lw=0.3)
    ax_row.axvline(t - args.window + 0.5, color="black", lw=1.2)
    ax_row.set_yticks([])
    ax_row.set_xlabel("key position")
    ax_row.set_title(f"query t={t}: {int(mask[t].sum())} keys attended (row dashed on the left)", fontsize=9)

    ax_scores = fig.add_subplot(right[1])
    straddling = (t - args.window) // args.block_size
    colours = []
    for j in range(num_blocks):
        if j in chosen:
            colours.append(CATEGORY_COLOURS[RETRIEVED])
        elif j < int(limits[t]):
            colours.append("#bdbdbd")
        else:
            colours.append("#ffffff")
    ax_scores.bar(range(num_blocks), scores[t], color=colours, edgecolor="black", linewidth=0.5)
    ax_scores.axhline(0, color="black", lw=0.5)
    low, high = float(scores[t].min()), float(scores[t].max())
    ax_scores.set_ylim(min(low, 0) * 1.15, high + 0.75 * (high - min(low, 0)))
    ax_scores.axvline(int(limits[t]) - 0.5, color=CATEGORY_COLOURS[WINDOW], lw=1.2)
    ax_scores.text(int(limits[t]) - 0.3, high * 1.05, "not candidates:\nin the window\nor future", fontsize=7, va="bottom")
    ax_scores.annotate(
        f"block {straddling} straddles the window edge (black line above):\n"
        f"keys {straddling * args.block_size}..{t - args.window} come from retrieval, "
        f"keys {t - args.window + 1}..{(straddling + 1) * args.block_size - 1} from the window;\n"
        "no key is counted twice",
        xy=(straddling, float(scores[t, straddling])), xytext=(0.02, 0.97), textcoords="axes fraction", fontsize=7,
        va="top", arrowprops=dict(arrowstyle="->", lw=0.7),
    )
    ax_scores.set_xticks(range(num_blocks))
    ax_scores.tick_params(axis="x", labelsize=7)
    ax_scores.set_xlabel("block j (positions j*B .. j*B+B-1); candidates: j*B <= t-W")
    ax_scores.set_ylabel("score: query . block mean key")
    ax_scores.set_title(f"top {args.top_n} of {int(limits[t])} candidate blocks retrieved: {chosen}", fontsize=9)

    handles = [Patch(facecolor=c, edgecolor="black", linewidth=0.5, label=n) for c, n in zip(CATEGORY_COLOURS, CATEGORY_NAMES)]
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=8, frameon=False)
    return fig


def main(argv=None):
    args = parse_args(argv)
    generator = torch.Generator().manual_seed(args.seed)
    keys, queries, topics = topic_sequence(args, generator)
    mask, scores, block_ids, valid, limits = ann_selection(
        keys, queries, args.window, args.block_size, args.top_n, args.summary
    )
    fig = draw(args, mask, scores, block_ids, valid, limits, topics)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
