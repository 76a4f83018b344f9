"""How far can exact selection by group bounds prune a trained model's keys? The best case, counted.

Exact top-n by branch and bound (model/pruned_selection.py) skips a group of blocks only when an
upper bound of every score inside it is below the query's n-th best score tau. Whatever the
search order, a group whose bound is >= tau must be opened and its candidate blocks scored. This
script counts those blocks for the true tau (known here from scoring everything), so its fractions
are a floor for any search over the same groups: per query, and per group of --query_group
consecutive queries (the union they open, since a group's queries share one matmul; every query of
the group scores all of it, so near the start of a text it can pass 1 slightly).

Groupings of --group_blocks blocks each, per layer and kv head:
    positional  runs of consecutive blocks (pruned_select's super-blocks), box bound: the
                channel-wise [max, min] of the group's summaries against [relu(x), min(x, 0)];
    kmeans      the same number of groups, formed by k-means over the summaries (content, not
                position); the bound is the tighter of the box and the ball around the group's
                mean (x . mean + |x| * radius).
The queries are the last --queries positions of the text, each with its causal candidates.

    python benchmarks/bench_bounds.py --model out/prose_ann/model --text dataset/prose/copy/prose_heldout_kjv.txt \\
        --tokens 32768 --json docs/bench/bounds_model.json
"""

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import format_table, machine_info, model_keys, set_threads, write_json
from model.retrieval import block_summaries, candidate_count


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a trained ANN model folder, out dir or checkpoint")
    p.add_argument("--text", required=True, help="the text it reads")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--layers", type=int, nargs="+", default=None, help="default: every layer")
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--query_group", type=int, default=32)
    p.add_argument("--group_blocks", type=int, nargs="+", default=[4, 8, 32])
    p.add_argument("--kmeans_iters", type=int, default=10)
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.queries % args.query_group:
        p.error(f"--queries {args.queries} must be a multiple of --query_group {args.query_group}")
    if not Path(args.text).is_file():
        p.error(f"--text {args.text}: no such file")
    return args


def kmeans(points, count, iters, generator):
    """points (m, e) -> the group of each point (m,) long: k-means with `count` groups."""
    centers = points[torch.randperm(points.shape[0], generator=generator)[:count]].clone()
    for _ in range(iters):
        groups = torch.cdist(points, centers).argmin(1)
        sizes = torch.bincount(groups, minlength=count).clamp(min=1)[:, None]
        centers = torch.zeros_like(centers).index_add_(0, groups, points) / sizes
    return torch.cdist(points, centers).argmin(1)


def group_upper_bounds(x, points, groups, count, ball):
    """x (s, e) queries, points (m, e) summaries, groups (m,) -> (s, count): an upper bound of x . p
    over each group's points (box; with ball, the tighter of box and ball)."""
    index = groups[:, None].expand_as(points)
    hi = points.new_full((count, points.shape[1]), float("-inf")).scatter_reduce(0, index, points, "amax")
    lo = points.new_full((count, points.shape[1]), float("inf")).scatter_reduce(0, index, points, "amin")
    bound = x.clamp(min=0) @ hi.nan_to_num(0, 0, 0).T + x.clamp(max=0) @ lo.nan_to_num(0, 0, 0).T
    if not ball:
        return bound
    sizes = torch.bincount(groups, minlength=count).clamp(min=1)[:, None]
    means = torch.zeros(count, points.shape[1]).index_add_(0, groups, points) / sizes
    radius = torch.zeros(count).scatter_reduce(0, groups, (points - means[groups]).norm(dim=1), "amax")
    return torch.minimum(bound, x @ means.T + x.norm(dim=1, keepdim=True) * radius)


def opened_fractions(x, points, limits, groups, count, top_n, query_group, ball):
    """-> (per query, per query group): the fraction of the queries' candidate blocks inside groups
    whose bound is >= the query's true n-th best candidate score."""
    scores = x @ points.T
    candidate = torch.arange(points.shape[0])[None] < limits[:, None]
    tau = scores.masked_fill(~candidate, float("-inf")).topk(top_n, dim=1).values[:, -1:]
    # A rounding margin, as pruned_select keeps: a bound equal to tau within float error is opened.
    opened = group_upper_bounds(x, points, groups, count, ball) >= tau - 1e-4 * tau.abs().clamp(min=1)
    scored = opened.gather(1, groups[None].expand(x.shape[0], -1)) & candidate
    per_group = scored.unflatten(0, (-1, query_group)).any(1) & candidate.unflatten(0, (-1, query_group)).any(1)
    candidates = candidate.sum().item()
    return scored.sum().item() / candidates, per_group.sum().item() * query_group / candidates


def main(argv=None):
    args = parse_args(argv)
    set_threads(args.threads)
    captured, config = model_keys(args.model, args.text, args.tokens, args.layers, args.chunk)
    block_size, generator = config.ann_block_size, torch.Generator().manual_seed(args.seed)
    top_n = config.ann_top_n
    rows = []
    for layer, (keys, group_queries) in captured.items():
        num_blocks = keys.shape[2] // block_size
        summaries = block_summaries(keys, 0, num_blocks, block_size, config.ann_block_summary)[0]
        end = num_blocks * block_size
        positions = torch.arange(end - args.queries, end)
        limits = candidate_count(positions[None], config.ann_window, block_size)[0]
        for head in range(summaries.shape[0]):
            x, points = group_queries[0, head, end - args.queries:end], summaries[head]
            for size in args.group_blocks:
                count = -(-num_blocks // size)
                for grouping in ("positional", "kmeans"):
                    if grouping == "positional":
                        groups = torch.arange(num_blocks) // size
                    else:
                        groups = kmeans(points, count, args.kmeans_iters, generator)
                    per_query, per_group = opened_fractions(x, points, limits, groups, count, top_n,
                                                            args.query_group, ball=grouping == "kmeans")
                    rows.append(dict(layer=layer, head=head, blocks=num_blocks, group_blocks=size, grouping=grouping,
                                     per_query=per_query, per_query_group=per_group))
    columns = [("layer", "layer", "{}"), ("head", "head", "{}"), ("blocks", "blocks", "{}"),
               ("group", "group_blocks", "{}"), ("grouping", "grouping", "{}"),
               ("scored per query", "per_query", "{:.3f}"), (f"per {args.query_group} queries", "per_query_group", "{:.3f}")]
    print(format_table(rows, columns))
    if args.json:
        write_json(args.json, vars(args), rows, machine=machine_info("cpu"), model=dict(
            top_n=top_n, block_size=block_size, window=config.ann_window, summary=config.ann_block_summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
