"""Exact block selection: exact_select (every candidate scored) against pruned_select (branch and
bound over super-block bounds), side by side in one process.

For each number of blocks m (--blocks) and each kind of keys (--keys) it builds per-token keys of
m*B tokens (b=1, --kv_heads, --head_dim), their block summaries (--summary) and one tile of
--queries query positions at the end of the text (limits as a tile of consecutive tokens has:
m - 1 - (T-1-i) // B candidates for query i), then times one call of each selection on that tile
(median of --repeats interleaved rounds, --threads torch threads) and counts what pruned_select
scored: exact block scores and super-block bounds, as fractions of the query-block scores that
exact_select computes. Every row checks that both selections agree (sorted selected scores within
1e-5 relative).

Keys (all with queries made to look for something in the text):
    random   i.i.d. Gaussian keys and queries: no structure, the worst case for bounds;
    topics   a slowly drifting mean shared by all keys, the passage's topic (one of 64 points in a
             rank-16 subspace, in runs of about 8 blocks), the token's own vector (4096 tokens) and
             noise; a query seeks one topic and one token of the text;
    documents  topics in runs of about 128 blocks (2k tokens), as documents that stay on a subject;
    repeats  topics, but the text is one 64-block passage over and over (many equal summaries);
    needle   random keys, and top_n blocks spread over the text whose keys all lie far along the
             queries' common direction: every query's best blocks by a wide margin (a passkey).

    python benchmarks/bench_selection.py --threads 1 --repeats 3 --json docs/bench/selection.json

A trained model's keys (--model DIR --text FILE): the model prefills the first --tokens tokens of
the text through its KV cache, --chunk at a time, once with exact and once with pruned retrieval
(interleaved, --repeats rounds); exact_ms / pruned_ms are whole prefills, and the fractions are
the pruned calls' counts summed over every layer (calls with fewer than --min_blocks candidates
score exactly and are not counted). Every row checks that the two prefills' last logits agree
(within 1e-4 of their scale).

    python benchmarks/bench_selection.py --model out/prose_ann/model --text dataset/prose/copy/prose_heldout_kjv.txt \
        --tokens 32768 65536 --threads 1 --repeats 1
"""

import argparse
import json
import math
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoTokenizer

from benchmarks.common import format_table
from common.cpu_memory import retain_freed_memory
from evaluation.loading import tokenizer_folder
from model.config import MiniMindConfig
from model.model import MiniMindForCausalLM
from model.pruned_selection import DEFAULT_GROUP_SIZES, DEFAULT_QUERY_GROUP, MIN_PRUNED_BLOCKS, SuperBlockBounds, pruned_select
from model.retrieval import PrunedRetriever, block_summaries, exact_select, selection_queries

KEY_KINDS = ("random", "topics", "documents", "repeats", "needle")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[512, 2048, 8192, 65536])
    p.add_argument("--keys", nargs="+", choices=KEY_KINDS, default=list(KEY_KINDS))
    p.add_argument("--summary", nargs="+", choices=("bounds", "mean"), default=["bounds", "mean"])
    p.add_argument("--queries", type=int, default=256, help="queries per tile, as ANN attention's QUERY_TILE")
    p.add_argument("--top_n", type=int, default=4)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--group_sizes", type=int, nargs="+", default=list(DEFAULT_GROUP_SIZES))
    p.add_argument("--query_group", type=int, default=DEFAULT_QUERY_GROUP)
    p.add_argument("--seed_width", type=int, default=None, help="default: top_n")
    p.add_argument("--min_blocks", type=int, default=MIN_PRUNED_BLOCKS, help="below it pruned_select scores every candidate")
    p.add_argument(
        "--allocator", choices=("retain", "system"), default="retain",
        help="retain: freed memory stays in the process (common/cpu_memory.py), as in the trainers",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--model", default=None, help="a trained ANN model folder: measure on its keys (--text)")
    p.add_argument("--text", default=None, help="with --model: the text it prefills")
    p.add_argument("--tokens", type=int, nargs="+", default=[32768], help="with --model: prefill lengths")
    p.add_argument("--chunk", type=int, default=4096, help="with --model: prefill chunk")
    args = p.parse_args(argv)
    if (args.model is None) != (args.text is None):
        p.error("--model and --text go together")
    if args.text is not None and not Path(args.text).is_file():
        p.error(f"--text {args.text}: no such file")
    return args


def make_keys(kind, num_tokens, num_queries, kv_heads, heads, head_dim, block_size, seed, needles=1):
    """-> keys (1, g, t, d) and queries (1, h, T, d) of one kind (see the module docstring);
    needle: `needles` blocks spread over the text."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    group = heads // kv_heads
    if kind in ("random", "needle"):
        keys = randn(1, kv_heads, num_tokens, head_dim)
        queries = randn(1, heads, num_queries, head_dim)
        if kind == "needle":
            direction = randn(kv_heads, 1, head_dim)
            direction = direction / direction.norm(dim=-1, keepdim=True)
            queries = queries + 3.0 * direction.repeat_interleave(group, dim=0)[None]
            num_blocks = num_tokens // block_size
            for index in range(needles):
                needle = num_blocks * (index + 1) // (needles + 1) * block_size
                keys[:, :, needle : needle + block_size] = 100.0 * direction + randn(kv_heads, block_size, head_dim)
        return keys, queries
    rank, topics, vocabulary = 16, 64, 4096
    basis = randn(kv_heads, rank, head_dim) / rank**0.5
    topic_points = 2.0 * randn(kv_heads, topics, rank)
    token_vectors = 0.7 * randn(kv_heads, vocabulary, head_dim)
    text_tokens = min(num_tokens, 64 * block_size) if kind == "repeats" else num_tokens
    num_blocks = -(-text_tokens // block_size)
    mean_run = 128 if kind == "documents" else 8
    run_lengths = (torch.rand(num_blocks, generator=generator).log() / math.log(1 - 1 / mean_run)).long() + 1
    block_topics = torch.randint(topics, (num_blocks,), generator=generator).repeat_interleave(run_lengths)[:num_blocks]
    token_topics = block_topics.repeat_interleave(block_size)[:text_tokens]
    tokens = torch.randint(vocabulary, (text_tokens,), generator=generator)
    mean = 1.5 * randn(kv_heads, 1, head_dim) + (0.003 * randn(kv_heads, text_tokens, head_dim)).cumsum(1)
    keys = mean + topic_points[:, token_topics] @ basis + token_vectors[:, tokens] + 0.3 * randn(kv_heads, text_tokens, head_dim)
    if kind == "repeats":
        keys = keys.repeat(1, -(-num_tokens // text_tokens), 1)[:, :num_tokens]
    sought = torch.randint(text_tokens, (num_queries,), generator=generator)
    group_queries = (
        topic_points[:, token_topics[sought]] @ basis + 1.5 * token_vectors[:, tokens[sought]]
        + 0.3 * randn(kv_heads, num_queries, head_dim) + 0.5 * randn(kv_heads, 1, head_dim)
    )
    queries = group_queries.repeat_interleave(group, dim=0) + 0.3 * randn(heads, num_queries, head_dim)
    return keys[None], queries[None]


def summaries_in_chunks(keys, num_blocks, block_size, summary, chunk_blocks=4096):
    """block_summaries of blocks 0 .. m-1, a chunk at a time (the same values, less scratch memory)."""
    parts = [
        block_summaries(keys, first, min(first + chunk_blocks, num_blocks), block_size, summary)
        for first in range(0, num_blocks, chunk_blocks)
    ]
    return torch.cat(parts, dim=2)


def tile_limits(num_blocks, num_queries, block_size):
    """(1, T): the candidates of T consecutive queries whose last one has m - 1 of them."""
    behind = torch.arange(num_queries - 1, -1, -1) // block_size
    return (num_blocks - 1 - behind).clamp(min=0)[None]


def selected_scores(group_queries, summaries, ids, valid):
    """Sorted scores of the selected blocks (b, g, s, n); invalid slots as -inf."""
    chosen = summaries[:, :, None].expand(-1, -1, ids.shape[2], -1, -1)
    index = ids[..., None].expand(-1, -1, -1, -1, summaries.shape[-1])
    scores = (chosen.gather(3, index) * group_queries[:, :, :, None]).sum(-1)
    return scores.masked_fill(~valid, float("-inf")).sort(dim=-1).values


def time_interleaved(calls, repeats):
    """{name: median seconds} over `repeats` rounds of one call each, after one warm-up round."""
    times = {name: [] for name in calls}
    for round_index in range(repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if round_index:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def measure(args, kind, summary, num_blocks):
    keys, queries = make_keys(
        kind, num_blocks * args.block_size, args.queries, args.kv_heads, args.heads, args.head_dim,
        args.block_size, args.seed, needles=args.top_n,
    )
    summaries = summaries_in_chunks(keys, num_blocks, args.block_size, summary)
    del keys
    group_queries = selection_queries(queries, args.kv_heads, summary)
    limits = tile_limits(num_blocks, args.queries, args.block_size)
    settings = dict(query_group=args.query_group, seed_width=args.seed_width, min_blocks=args.min_blocks)
    bounds = SuperBlockBounds.of(summaries, args.group_sizes)
    stats = {}
    pruned = pruned_select(group_queries, summaries, limits, args.top_n, bounds, stats, **settings)
    exact = exact_select(group_queries, summaries, limits, args.top_n)
    difference = (selected_scores(group_queries, summaries, *exact) - selected_scores(group_queries, summaries, *pruned))
    scale = selected_scores(group_queries, summaries, *exact).nan_to_num(0, 0, 0).abs().max().clamp(min=1)
    agree = bool((difference.nan_to_num(0) / scale).abs().max() <= 1e-5)
    times = time_interleaved(
        {
            "exact": lambda: exact_select(group_queries, summaries, limits, args.top_n),
            "pruned": lambda: pruned_select(group_queries, summaries, limits, args.top_n, bounds, **settings),
            "bounds_build": lambda: SuperBlockBounds.of(summaries, args.group_sizes),
        },
        args.repeats,
    )
    return dict(
        keys=kind, summary=summary, blocks=num_blocks, tokens=num_blocks * args.block_size,
        exact_ms=1e3 * times["exact"], pruned_ms=1e3 * times["pruned"], speedup=times["exact"] / times["pruned"],
        exact_fraction=stats.get("exact_scores", 0) / stats["dense_scores"],
        bound_fraction=stats.get("bound_scores", 0) / stats["dense_scores"],
        build_ms=1e3 * times["bounds_build"], agree=agree,
    )


@torch.no_grad()
def prefill(model, ids, chunk):
    """ids (1, t) -> (the last chunk's logits, the cache): the whole text through the KV cache."""
    cache = model.new_cache(reserve=ids.shape[1])
    for start in range(0, ids.shape[1], chunk):
        logits = model(input_ids=ids[:, start:start + chunk], cache=cache, use_cache=True).logits
    return logits, cache


def measure_model(args, models, tokenizer, num_tokens):
    """One row: prefills of `num_tokens` tokens of args.text with models["exact"] and models["pruned"]."""
    ids = tokenizer(Path(args.text).read_text(encoding="utf-8"))["input_ids"][:num_tokens]
    if len(ids) < num_tokens:
        raise SystemExit(f"--text {args.text}: {len(ids)} tokens, fewer than --tokens {num_tokens}")
    ids = torch.tensor([ids])
    exact_logits, _ = prefill(models["exact"], ids, args.chunk)
    pruned_logits, cache = prefill(models["pruned"], ids, args.chunk)
    scale = exact_logits.abs().max().clamp(min=1)
    agree = bool(((exact_logits - pruned_logits).abs().max() / scale) <= 1e-4)
    stats = {}
    for layer in cache.layers:
        for key, count in layer.retriever.stats.items():
            stats[key] = stats.get(key, 0) + count
    times = time_interleaved({kind: lambda model=model: prefill(model, ids, args.chunk) for kind, model in models.items()},
                             args.repeats)
    config = models["exact"].config
    dense_scores = stats.get("dense_scores", 0)
    return dict(
        keys=f"model:{Path(args.text).stem}", summary=config.ann_block_summary, blocks=num_tokens // config.ann_block_size,
        tokens=num_tokens, exact_ms=1e3 * times["exact"], pruned_ms=1e3 * times["pruned"],
        speedup=times["exact"] / times["pruned"],
        exact_fraction=stats.get("exact_scores", 0) / dense_scores if dense_scores else None,
        bound_fraction=stats.get("bound_scores", 0) / dense_scores if dense_scores else None,
        build_ms=None, agree=agree,
    )


def load_models(args):
    """{"exact": model, "pruned": model} and the tokenizer, from args.model."""
    models = {}
    for kind in ("exact", "pruned"):
        config = MiniMindConfig.from_pretrained(args.model)
        if config.attn_impl != "ann":
            raise SystemExit(f"--model {args.model}: a {config.attn_impl} model; selection needs an ANN model")
        config.ann_retrieval = kind
        models[kind] = MiniMindForCausalLM.from_pretrained(args.model, config=config).eval()
    return models, AutoTokenizer.from_pretrained(tokenizer_folder(args.model))


COLUMNS = [
    ("keys", "keys", "{}"), ("summary", "summary", "{}"), ("blocks", "blocks", "{}"), ("tokens", "tokens", "{}"),
    ("exact ms", "exact_ms", "{:.2f}"), ("pruned ms", "pruned_ms", "{:.2f}"), ("speedup", "speedup", "{:.2f}x"),
    ("blocks scored", "exact_fraction", "{:.3f}"), ("bounds scored", "bound_fraction", "{:.3f}"),
    ("bounds build ms", "build_ms", "{:.2f}"), ("same top-n", "agree", "{}"),
]


def main(argv=None):
    args = parse_args(argv)
    if args.allocator == "retain" and not retain_freed_memory():
        print("--allocator retain: no glibc mallopt here, the system allocator stays", file=sys.stderr)
    torch.set_num_threads(args.threads)
    PrunedRetriever.min_blocks = args.min_blocks
    rows = []
    if args.model:
        models, tokenizer = load_models(args)
        measurements = (partial(measure_model, args, models, tokenizer, num_tokens) for num_tokens in args.tokens)
    else:
        measurements = (partial(measure, args, kind, summary, num_blocks)
                        for num_blocks in args.blocks for kind in args.keys for summary in args.summary)
    for run in measurements:
        rows.append(run())
        print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    print()
    print(format_table(rows, COLUMNS))
    if args.json:
        config = {key: value for key, value in vars(args).items() if key != "json"}
        machine = dict(platform=platform.platform(), processor=platform.processor(), torch=torch.__version__)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(config=config, machine=machine, rows=rows), indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
