"""Serving: time to first token of a long conversation's next turn with and without the prefix
cache, and generated tokens/s with several concurrent streams.

    python benchmarks/bench_serving.py                                  # 4k, 32k, 128k histories
    python benchmarks/bench_serving.py --lengths 256 1024 --concurrency 1 2 --json /tmp/serving.json
    python benchmarks/bench_serving.py --load out/long_ann --threads 2

It drives serving/engine.py in-process (the server's engine, without HTTP). A conversation's turn k
arrives as its whole history of L tokens plus --turn_tokens new ones. With the prefix cache the
history's cache is there from turn k-1 (an untimed request put it there) and only the new tokens
are prefilled; without it (--cache_mb 0 in the server) all L + turn_tokens are. Time to first token
is submit to the first generated token, the engine's copy of the prompt cache included. Concurrency
rows start c streams of --stream_prompt random tokens at once and count their generated tokens over
the wall time until the last ends (the engine steps them in turn, one batch-1 forward each).

Without --load the model is random (hidden 64, 2 layers, ANN attention with the config's window,
blocks and top-n, exact retrieval): timings depend on sizes, not on weights. Token ids are random.
Writes docs/bench/serving.json and a plot next to it (--json PATH, PATH with .png).
"""

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import queue

import torch
from transformers import AutoTokenizer

from benchmarks.common import add_allocator_flag, apply_allocator, format_table, machine_info, plot_panels, \
    png_path_for, set_threads, write_json
from evaluation.loading import SHIPPED_TOKENIZER, load_model, resolve_load_path
from model.config import MiniMindConfig
from model.model import MiniMindForCausalLM
from serving.engine import Engine, Finished, Job
from serving.prefix_cache import PrefixCache


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", default=None, help="a trained model (default: a random tiny ANN model)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072], help="history tokens")
    p.add_argument("--turn_tokens", type=int, default=32, help="new tokens of the timed turn")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--stream_prompt", type=int, default=128)
    p.add_argument("--stream_tokens", type=int, default=64, help="tokens generated per stream")
    p.add_argument("--prefill_chunk", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="docs/bench/serving.json")
    add_allocator_flag(p)
    return p.parse_args(argv)


def random_model(context):
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=context, attn_impl="ann")
    return MiniMindForCausalLM(config).eval(), AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)


class Runner:
    """An engine on the model and a way to run jobs to the end: (seconds to finish, tokens) each."""

    def __init__(self, model, tokenizer, cache_bytes, prefill_chunk, max_active=8):
        self.engine = Engine(model, tokenizer, PrefixCache(cache_bytes), max_active, prefill_chunk)
        self.engine.eos_id = None  # a random model's eos would end a stream early
        self.engine.start()

    def run(self, prompts, max_tokens):
        """Submit every prompt at once -> [(seconds from submit to finish, generated tokens)] in prompt order."""
        done = queue.Queue()
        start = time.perf_counter()
        for index, prompt in enumerate(prompts):
            def emit(event, index=index):
                if isinstance(event, Finished):
                    done.put((index, time.perf_counter() - start, event.completion_tokens))
            self.engine.submit(Job(prompt_ids=prompt, max_tokens=max_tokens, emit=emit))
        results = sorted(done.get() for _ in prompts)
        return [(seconds, tokens) for _, seconds, tokens in results]


def random_ids(length, generator):
    return torch.randint(3, 6400, (length,), generator=generator).tolist()


def first_token_rows(model, tokenizer, args, generator):
    rows = []
    warm = Runner(model, tokenizer, 1 << 40, args.prefill_chunk)
    for _ in range(2):  # allocator, thread pools and the cache copy settle
        warm.run([random_ids(args.turn_tokens, generator)], 2)
    for length in args.lengths:
        history = random_ids(length, generator)
        turn = history + random_ids(args.turn_tokens, generator)
        cached = Runner(model, tokenizer, 1 << 40, args.prefill_chunk)
        cached.run([history], 1)  # turn k-1 leaves the history's cache
        with_cache = cached.run([turn], 1)[0][0]
        cached.engine.prefix_cache.entries.clear()  # the idle engine thread keeps its prefix cache
        without = Runner(model, tokenizer, 0, args.prefill_chunk).run([turn], 1)[0][0]
        rows.append({"kind": "first_token", "history": length, "ttft_cached_s": with_cache,
                     "ttft_uncached_s": without, "speedup": without / with_cache})
        print(f"history {length}: first token {with_cache:.3f} s with the prefix cache, {without:.3f} s without",
              flush=True)
    return rows


def concurrency_rows(model, tokenizer, args, generator):
    rows = []
    runner = Runner(model, tokenizer, 0, args.prefill_chunk, max_active=max(args.concurrency))
    runner.run([random_ids(args.stream_prompt, generator)], 4)  # warm-up
    for streams in args.concurrency:
        results = runner.run([random_ids(args.stream_prompt, generator) for _ in range(streams)], args.stream_tokens)
        wall = max(seconds for seconds, _ in results)
        tokens = sum(count for _, count in results)
        rows.append({"kind": "concurrency", "streams": streams, "tokens": tokens, "wall_s": wall,
                     "tokens_per_s": tokens / wall, "per_stream_tokens_per_s": tokens / wall / streams})
    return rows


def main(argv=None):
    args = parse_args(argv)
    apply_allocator(args.allocator)
    set_threads(args.threads)
    context = max(args.lengths) + args.turn_tokens + 8
    if args.load:
        model, tokenizer = load_model(resolve_load_path(args.load), None, None, torch.device("cpu"))
    else:
        model, tokenizer = random_model(context)
    generator = torch.Generator().manual_seed(0)
    first = first_token_rows(model, tokenizer, args, generator)
    streams = concurrency_rows(model, tokenizer, args, generator)
    print(format_table(first, [("history", "history", "{}"), ("ttft cached s", "ttft_cached_s", "{:.3f}"),
                               ("ttft uncached s", "ttft_uncached_s", "{:.3f}"), ("speedup", "speedup", "{:.1f}x")]))
    print(format_table(streams, [("streams", "streams", "{}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
                                 ("per stream", "per_stream_tokens_per_s", "{:.1f}"), ("wall s", "wall_s", "{:.2f}")]))
    config = {key: value for key, value in vars(args).items() if key != "json"}
    config["model"] = {key: getattr(model.config, key) for key in (
        "hidden_size", "num_hidden_layers", "attn_impl", "ann_window", "ann_block_size", "ann_top_n", "ann_retrieval")}
    write_json(args.json, config, first + streams, machine=machine_info("cpu"))
    plot_panels(png_path_for(args.json), "Serving (serving/engine.py)", [
        ("Time to first token of the next turn", "history tokens", "seconds",
         {"prefix cache": [(row["history"], row["ttft_cached_s"]) for row in first],
          "no cache": [(row["history"], row["ttft_uncached_s"]) for row in first]}),
        ("Generated tokens/s", "concurrent streams", "tokens/s",
         {"all streams": [(row["streams"], row["tokens_per_s"]) for row in streams],
          "per stream": [(row["streams"], row["per_stream_tokens_per_s"]) for row in streams]}, "linear"),
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
