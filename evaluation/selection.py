"""How a trained model's block selection ranks the block a query needs: the tools behind
scripts/probe_selection.py and the benchmarks that run on a model's own keys.

Legend (as in model/ann_attention.py):
    h heads   g kv heads   t keys   d head dim   m candidate blocks   e summary dim

A query at position t selects its top_n candidate blocks (those ending at or before t - W) by
summary score (model/retrieval.py). For one target block this module ranks it three ways among
the query's candidates, per kv head (a GQA group selects its blocks together):

    summary    the score selection uses: the group's query against the block's summary
    max_logit  sum over the group's heads of each head's largest q . k / sqrt(d) in the block: the
               score a perfectly tight bounds summary would give
    mass       log of the attention weight the group's heads would give the block's keys if every
               candidate were visible (log-sum-exp of q . k / sqrt(d) over heads and keys)

A target that ranks high by max_logit or mass but low by summary is lost to the summary; one that
ranks low by all three is lost to the queries and keys themselves. Optionally a fourth ranking,
hnsw_keys, is what "keys" selection through HNSW finds: the model's graph over the candidate keys
of each kv head (`hnsw_key_scores`).
"""

import math
import time
from pathlib import Path

import torch

from model.hnsw import KeyHnswRetriever
from model.retrieval import block_summaries, candidate_count, selection_queries, summary_scores

RANKINGS = ("summary", "max_logit", "mass")


class RecordingCore:
    """Stands in for one layer's attention core and records, in the frame retrieval scores in, its
    stored keys (b, g, t, d) and per-head queries (b, h, t, d) of every call, in call order; the
    queries as the core attends with them (log-n scaled where the layer scales them)."""

    def __init__(self, core, kv_heads):
        self.core = core
        self.kv_heads = kv_heads
        self.keys, self.queries = [], []

    def __getattr__(self, name):
        return getattr(self.core, name)

    def __call__(self, q, k, v, starts, ends, layer_cache, rope, spans=None):
        scaled = self.core.logn_queries(q, rope.positions, int(rope.positions.max()))
        _, block_q = self.core.query_frames(scaled, rope)
        self.keys.append(self.core.stored_frame(k, rope).detach().float())
        self.queries.append(block_q.detach().float())
        return self.core(q, k, v, starts, ends, layer_cache, rope, spans)

    def recorded(self):
        """(keys (b, g, t, d), queries (b, h, t, d)) of everything recorded."""
        return torch.cat(self.keys, dim=2), torch.cat(self.queries, dim=2)

    def group_queries(self):
        """(b, g, t, e): the GQA group vectors that score blocks (model/retrieval.selection_queries)."""
        return selection_queries(torch.cat(self.queries, dim=2), self.kv_heads, self.core.summary)


def record_layers(model, layers=None):
    """Wrap the attention cores of `layers` (None: all) in RecordingCores -> {layer: recorder}."""
    layers = range(model.config.num_hidden_layers) if layers is None else layers
    recorders = {}
    for layer in layers:
        attention = model.model.layers[layer].self_attn
        recorders[layer] = attention.core = RecordingCore(attention.core, model.config.num_key_value_heads)
    return recorders


@torch.inference_mode()
def prefill(model, token_ids, chunk, cache=None):
    """Run token_ids (a list) through `cache` (None: a new one) `chunk` tokens at a time (0: at once)
    -> the logits (vocab,) that follow the last token."""
    cache = model.new_cache() if cache is None else cache
    input_ids = torch.tensor([token_ids], device=model.device)
    step = chunk or input_ids.shape[1]
    for begin in range(0, input_ids.shape[1], step):
        logits = model(input_ids[:, begin : begin + step], cache=cache, use_cache=True, logits_to_keep=1).logits
    return logits[0, -1]


@torch.inference_mode()
def teacher_forced(model, prompt_ids, answer_ids, chunk):
    """(a, vocab): the model's next-token distribution before each of the a answer tokens, given the
    prompt and the answer before it: the prompt prefilled `chunk` tokens at a time, then all but the
    answer's last token in one call (which equals decoding them one by one)."""
    cache = model.new_cache()
    logits = [prefill(model, prompt_ids, chunk, cache)[None]]
    if len(answer_ids) > 1:
        following = torch.tensor([answer_ids[:-1]], device=model.device)
        logits.append(model(following, cache=cache, use_cache=True).logits[0])
    return torch.cat(logits).float().cpu().softmax(dim=-1)


def token_chances(distributions, token_ids):
    """distributions (a, vocab), a token id per row -> ((a,) each token's probability, (a,) whether it
    is the most likely one)."""
    expected = torch.tensor(token_ids)
    return distributions[torch.arange(len(token_ids)), expected], distributions.argmax(dim=-1) == expected


def rank_of(scores, target):
    """scores (g, m), target block index -> (g,) its 1-based rank: 1 + how many score strictly higher."""
    return (scores > scores[:, target : target + 1]).sum(dim=1) + 1


def hnsw_key_scores(queries, keys, block_size, config):
    """queries (h, d), the m blocks' keys (g, m*B, d) -> (block scores (g, m), seconds building the
    graphs): what "keys" selection through HNSW (model/hnsw.KeyHnswRetriever, with config's HNSW
    settings) scores. Each kv head's graph gets the keys in position order; the
    blocks holding a key that one of the group's heads found get their exact best-key score, the
    others -inf (the search never offers them)."""
    h, d = queries.shape
    g, t, _ = keys.shape
    m = t // block_size
    retriever = KeyHnswRetriever(block_size, config.hnsw_keys_per_head, config.hnsw_m, config.hnsw_ef_construction,
                                 config.hnsw_ef_search)
    started = time.perf_counter()
    retriever.add_candidates(block_summaries(keys[None].float(), 0, m, block_size, "keys"), torch.tensor([[m]]))
    building = time.perf_counter() - started
    scores = torch.full((g, m), float("-inf"), dtype=torch.float64)
    group_queries = queries.float().view(g, 1, h // g, d).numpy()
    for head, graph in enumerate(retriever.graphs[0]):
        blocks, found = retriever.scored_candidates(graph, group_queries[head])
        kept = blocks[0] >= 0
        scores[head, torch.from_numpy(blocks[0][kept])] = torch.from_numpy(found[0][kept]).double()
    return scores, building


def block_scores(queries, keys, position, window, block_size, summary, hnsw=None):
    """One position's queries (h, d) and the keys (g, t, d) before it, both in the block frame ->
    ({ranking: scores (g, m)} over its m candidate blocks (RANKINGS, and hnsw_keys when `hnsw` is a
    model config whose HNSW settings hnsw_key_scores uses), seconds building HNSW graphs)."""
    h, d = queries.shape
    g = keys.shape[0]
    m = int(candidate_count(torch.tensor(position), window, block_size))
    summaries = block_summaries(keys[None], 0, m, block_size, summary)
    group_queries = selection_queries(queries[None, :, None], g, summary)
    logits = torch.einsum("grd,gkd->grk", queries.view(g, h // g, d), keys[:, : m * block_size]) / math.sqrt(d)
    logits = logits.view(g, h // g, m, block_size)
    scores = {
        "summary": summary_scores(group_queries, summaries)[0, :, 0],
        "max_logit": logits.amax(dim=3).sum(dim=1),
        "mass": logits.transpose(1, 2).reshape(g, m, -1).logsumexp(dim=2),
    }
    building = 0.0
    if hnsw is not None and m:
        scores["hnsw_keys"], building = hnsw_key_scores(queries, keys[:, : m * block_size], block_size, hnsw)
    return scores, building


def bounds_must_score(queries, keys, best_keys, block_size, top_n):
    """(g,) the share of a query's candidate blocks whose bounds score (an upper bound of the
    best-key score) reaches its top_n-th best-key score: the blocks that an exact best-key search
    pruning by bounds would still have to score in full. queries (h, d) and keys (g, t, d) as in
    block_scores, best_keys (g, m) its "max_logit" scores; None with top_n or fewer candidates."""
    h, d = queries.shape
    g, m = best_keys.shape
    if m <= top_n:
        return None
    bounds = summary_scores(selection_queries(queries[None, :, None], g, "bounds"),
                            block_summaries(keys[None], 0, m, block_size, "bounds"))[0, :, 0] / math.sqrt(d)
    nth_best = best_keys.topk(top_n, dim=1).values[:, -1:]
    return (bounds >= nth_best).double().mean(dim=1)


def target_ranks(scores, target_position, block_size):
    """{ranking: (g,) rank of the block holding target_position} from block_scores' scores, or None
    when that block is not a candidate (it is in the query's window)."""
    target = target_position // block_size
    if target >= scores["summary"].shape[1]:
        return None
    return {ranking: rank_of(values, target) for ranking, values in scores.items()}


def value_position(tokenizer, token_ids, value):
    """Index of the first token of the last run of tokens that spells `value` (an int) -> int, or
    None. Digits may share their first token with a leading space: the run's text is stripped."""
    digits = str(value)
    pieces = [tokenizer.decode([token]) for token in token_ids]
    for start in range(len(pieces) - 1, -1, -1):
        text = ""
        for end in range(start, len(pieces)):  # not pieces[start:]: a copy per start is quadratic
            text += pieces[end]
            stripped = text.strip()
            if stripped == digits:
                return start
            if not digits.startswith(stripped):
                break
    return None


def copy_targets(tokenizer, answer_ids, number_positions):
    """[(label, prompt position)] per answer token: what it copies from the numbers the prompt spells,
    the answer's k-th number from number_positions[k] on, one token per digit as the prose tokenizer
    splits numbers. Digit i of the first number ("d1", "d2",
    ...) copies that number's digit i, a token before it ("lead") its first digit, the token after it
    ("end") its last; a later number's labels carry its place ("n2.d1", ..., "n2.end"). Of the
    tokens between two numbers the first is the earlier one's end, the others the later one's lead
    (" 123, 456.": lead, d1-d3, end (","), n2.lead (" "), n2.d1-n2.d3, n2.end)."""
    positions = list(number_positions)
    pieces = [tokenizer.decode([token]).strip() for token in answer_ids]
    runs = []  # [first, last] answer index of each number's digits
    for index, piece in enumerate(pieces):
        if piece.isdigit():
            if runs and runs[-1][1] == index - 1:
                runs[-1][1] = index
            else:
                runs.append([index, index])
    if len(runs) != len(positions) or any(len(piece) != 1 for piece in pieces if piece.isdigit()):
        count = "one number" if len(positions) == 1 else f"{len(positions)} numbers"
        raise ValueError(f"the answer {pieces} does not spell {count} a digit per token")
    targets = []
    for index in range(len(answer_ids)):
        number = sum(first <= index for first, _ in runs[1:])  # the number this token is, or follows
        first, last = runs[number]
        prefix = f"n{number + 1}." if number else ""
        if first <= index <= last:
            targets.append((f"{prefix}d{index - first + 1}", positions[number] + index - first))
        elif index < first:
            targets.append(("lead", positions[0]))
        elif number + 1 < len(runs) and index > last + 1:  # between two numbers, after the end
            targets.append((f"n{number + 2}.lead", positions[number + 1]))
        else:
            targets.append((f"{prefix}end", positions[number] + last - first))
    return targets


def model_keys(model, tokenizer, text_path, num_tokens, layers, chunk):
    """{layer: (keys, group queries), each (1, g, t, d or e)} of a loaded ANN model over the first
    `num_tokens` tokens of a text, prefilled `chunk` at a time; layers None: every layer, a None
    entry: the middle one."""
    token_ids = tokenizer(Path(text_path).read_text(encoding="utf-8"))["input_ids"][:num_tokens]
    if len(token_ids) < num_tokens:
        print(f"{text_path} has only {len(token_ids)} tokens; using them all")
    count = model.config.num_hidden_layers
    layers = range(count) if layers is None else [count // 2 if layer is None else layer for layer in layers]
    recorders = record_layers(model, layers)
    prefill(model, token_ids, chunk)
    return {layer: (recorder.recorded()[0], recorder.group_queries()) for layer, recorder in recorders.items()}
