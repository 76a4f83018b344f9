"""Context parallelism: the KV cache of one sequence split by position over the ranks of a group.

Legend as in model/ann_attention.py (b = 1 here: one sequence), plus N ranks, rank r.

Layout (Shards). Rank r holds positions lo_r .. hi_r - 1, contiguous, in rank order; a rank may
hold none. It owns the window keys of its positions and the blocks j in [lo_r // B, hi_r // B):
those whose last position it holds. A block that starts on an earlier rank (a shard boundary
inside a block) is owned by the rank it ends on, which keeps a copy of its first keys (the halo,
fewer than B keys) so that its summary and its keys are whole there. Every block has one owner.

Attention (ShardedAttention, the per-layer core). A query at position t is answered by every rank:
    selection: each rank finds the top-n of its own candidate blocks (local_selection: exact
               scoring, or the rank's own HNSW graphs for hnsw/auto, whose blocks are then scored
               exactly) and returns it as (scores, global block ids); the global top-n is the best
               n of those N*n pairs. With exact retrieval that is the single-process selection;
               with HNSW it is wherever each shard's graphs find their shard's top-n (recall 1),
               and a shard's graph holds 1/N of the blocks, which raises recall. Ties: both the
               local and the global choice sort by score with a stable sort, and the pairs are
               concatenated in rank order, so among equal scores the lower block id wins, on every
               world size. exact_select takes torch.topk's choice among equal scores, so the two
               agree whenever the n-th best score is not tied.
    partial:   each rank attends over the window keys it owns and the selected blocks it owns and
               returns (max logit, sum of exponentials, exponential-weighted values), float32;
    merge:     the log-sum-exp rule (ring attention): M = max over ranks of the max logits, each
               partial is rescaled by exp(max - M), sums are added and divided. The same code runs
               for one rank, where every collective is the identity.
Prefill: each rank runs the model on its own tokens. Per layer, each rank sends the last few rows
of its layer input (token shift) and of its keys and values (halos) to all ranks (one all_gather
each), then the ranks take turns: the owner of a tile of queries broadcasts them, every rank
answers with its partial and the sum is reduced onto the owner. Decode: every rank runs the new
token (the layers are replicated; only attention is sharded), its key and value land on the last
rank, and every rank answers with its partial (all_reduce). auto chooses per query and shard by
the query's candidate count on that shard.
Training (ContextParallelLM.train_step): each rank all_gathers every rank's queries (one tile per
layer), answers them all with its partials and the all_reduce-sum merge, and keeps its own
positions; the backward runs through the same partials. The collectives that carry gradients are
autograd Functions with the adjoint collective (all_gather -> all_reduce-sum of the gathered
gradient, then this rank's slice; all_reduce-sum -> all_reduce-sum); the selection, the max of the
log-sum-exp rule and the summaries carry none (the merged output does not depend on the max).
"""

import atexit
import math
import os
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from .ann_attention import AnnAttention, block_tables
from .retrieval import ExactRetriever, candidate_count, candidate_scores, selection_queries
from .rope import Rope

NEG_INF = float("-inf")
IGNORE = -100  # cross-entropy target of a position with no next token
PREFILL_TILE = 512  # queries per broadcast during prefill: fewer collectives, O(T * (W + n*B)) memory


class ShardFailure(RuntimeError):
    """A collective of the context-parallel group failed: a peer rank died, hung or left."""


class ShardGroup:
    """The collectives of one context-parallel group; with one rank each is the identity.

    group: a torch.distributed process group, or None for a single process. bytes_sent counts the
    payload this rank hands to collectives (an all_reduce's transport sends about twice that).
    """

    def __init__(self, group=None):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.bytes_sent = 0
        self.messages = 0
        self.outputs = []  # differentiable collectives' outputs since the last backward (see differentiable)

    def run(self, name, operation, tensor):
        if self.size == 1:
            return
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.messages += 1
        try:
            operation()
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ShardFailure(
                f"context parallel rank {self.rank}/{self.size}: {name} failed (a peer rank died, hung or disagreed): {first_line}"
            ) from error

    def all_gather(self, tensor):
        """tensor (same shape on every rank) -> (N, *shape): every rank's, in rank order (differentiable)."""
        if self.size == 1:
            return tensor[None]
        return self.kept(AllGather.apply(self, self.differentiable(tensor)))

    def all_reduce(self, tensor, op):
        """A SUM with gradients enabled is differentiable (a new tensor); otherwise in place."""
        if op == dist.ReduceOp.SUM and torch.is_grad_enabled() and self.size > 1:
            return self.kept(AllReduceSum.apply(self, self.differentiable(tensor)))
        return self.all_reduce_in_place(tensor, op)

    def differentiable(self, tensor):
        """Every rank must run every collective's backward, in the same order: autograd runs a node
        only when an input needs a gradient and an output reaches a root, so a rank whose input needs
        none gets a leaf that does, and every output is kept (outputs) to be fed a zero gradient."""
        if torch.is_grad_enabled() and not tensor.requires_grad:
            tensor = tensor.detach().requires_grad_()
        return tensor

    def kept(self, out):
        if out.requires_grad:
            self.outputs.append(out)
        return out

    def raw_all_gather(self, tensor):
        out = tensor.new_empty(self.size * tensor.shape[0], *tensor.shape[1:])
        self.run("all_gather", lambda: dist.all_gather_into_tensor(out, tensor.contiguous(), group=self.group), tensor)
        return out.view(self.size, *tensor.shape)

    def broadcast(self, tensor, src):
        """tensor (filled on rank src), in place on every rank."""
        self.run("broadcast", lambda: dist.broadcast(tensor, dist.get_global_rank(self.group, src), group=self.group), tensor)
        return tensor

    def broadcast_text(self, text, src):
        """text (a str or None, read on rank src) -> the same on every rank."""
        data = torch.tensor(list(text.encode("utf-8")) if text is not None else [], dtype=torch.uint8)
        size = self.broadcast(torch.tensor([-1 if text is None else data.numel()]), src)
        if int(size) < 0:
            return None
        data = data if self.rank == src else torch.empty(int(size), dtype=torch.uint8)
        return bytes(self.broadcast(data, src).tolist()).decode("utf-8") if int(size) else ""

    def all_reduce_in_place(self, tensor, op):
        self.run("all_reduce", lambda: dist.all_reduce(tensor, op=op, group=self.group), tensor)
        return tensor

    def reduce(self, tensor, dst):
        """Summed in place onto rank dst (other ranks' tensors are left unspecified)."""
        self.run("reduce", lambda: dist.reduce(tensor, dist.get_global_rank(self.group, dst), group=self.group), tensor)
        return tensor


class AllGather(torch.autograd.Function):
    """(shape) -> (N, *shape); backward: the all_reduce-sum of the gathered gradient, this rank's slice."""

    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group = group
        return group.raw_all_gather(tensor)

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.group.all_reduce_in_place(grad.contiguous().clone(), dist.ReduceOp.SUM)[ctx.group.rank]


class AllReduceSum(torch.autograd.Function):
    """The sum over ranks, on every rank; backward: the all_reduce-sum of the gradients."""

    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group = group
        return group.all_reduce_in_place(tensor.clone(), dist.ReduceOp.SUM)

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.group.all_reduce_in_place(grad.contiguous().clone(), dist.ReduceOp.SUM)


def join_group(rank, world_size, init_method, timeout_s=60.0, backend="gloo"):
    """Join the default process group (timeout_s bounds every collective: a hung peer raises) -> ShardGroup."""
    if world_size == 1:
        return ShardGroup()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    # A gloo group still alive when the interpreter exits can abort the process from its threads'
    # destructors ("terminate called without an active exception") after all the work is done.
    atexit.register(leave_group)
    return ShardGroup(dist.group.WORLD)


def leave_group():
    if dist.is_initialized():
        dist.destroy_process_group()


def join_launch_group(timeout_s=1800.0):
    """The ShardGroup of a torchrun launch (RANK and WORLD_SIZE in the environment), or None for a
    plain process or a launch of one."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return None
    return join_group(int(os.environ["RANK"]), world_size, "env://", timeout_s)


def shard_prompt(model, group, prompt_ids):
    """(ContextParallelLM over `group` for a prompt of len(prompt_ids) tokens, this rank's ids (1, s)):
    the prompt split into whole blocks (split_by_blocks)."""
    bounds = split_by_blocks(len(prompt_ids), group.size, model.config.ann_block_size)
    local_ids = torch.tensor([prompt_ids[bounds[group.rank] : bounds[group.rank + 1]]], dtype=torch.long)
    return ContextParallelLM(model, group, bounds), local_ids


def split_by_blocks(length, world_size, block_size):
    """(N+1) bounds: whole blocks dealt out in contiguous runs of ceil(blocks / N), the tail to the last
    rank holding any; ranks past the prompt hold nothing."""
    blocks = -(-length // block_size)
    per_rank = -(-blocks // world_size) * block_size
    return tuple(min(length, rank * per_rank) for rank in range(world_size)) + (length,)


class Shards:
    """Which positions each rank holds: bounds (N+1) ints, rank r holds bounds[r] .. bounds[r+1]-1.

    The last rank's end grows as decoding appends keys there.
    """

    def __init__(self, bounds, block_size):
        if any(later < earlier for earlier, later in zip(bounds, bounds[1:])) or bounds[0] != 0:
            raise ValueError(f"shard bounds must start at 0 and never decrease, got {tuple(bounds)}")
        self.bounds = list(bounds)
        self.block_size = block_size
        self.decoding = False
        self.training = False

    def lo(self, rank):
        return self.bounds[rank]

    def hi(self, rank):
        return self.bounds[rank + 1]

    def base(self, rank):
        """The first position stored on rank r: its first block's start (halo included)."""
        return self.lo(rank) // self.block_size * self.block_size

    def blocks(self, rank):
        """(first, end) global ids of the blocks rank r owns: those whose last position it holds."""
        return self.lo(rank) // self.block_size, self.hi(rank) // self.block_size

    def grow(self, count):
        self.bounds[-1] += count


class Partial(NamedTuple):
    """One rank's share of the attention of T queries: top (b, g, T, r) the largest logit it saw
    (-inf: none), total (b, g, T, r) sum of exp(logit - top), weighted (b, g, T, r, d) sum of
    exp(logit - top) * value; all float32."""

    top: torch.Tensor
    total: torch.Tensor
    weighted: torch.Tensor


def partial_attention(logits, values):
    """logits (..., r, L) with -inf for hidden keys, values (..., L, d) or broadcastable -> Partial."""
    if not logits.shape[-1]:
        top = logits.new_full(logits.shape[:-1], NEG_INF)
        return Partial(top, torch.zeros_like(top), logits.new_zeros(*logits.shape[:-1], values.shape[-1]))
    top = logits.amax(dim=-1)
    shift = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(logits - shift[..., None])
    return Partial(top, weights.sum(dim=-1), weights @ values)


def merge_partials(group, partial, dst):
    """Partial of each rank -> (b, g, T, r, d) float32 attention output: the log-sum-exp rule.

    dst: the rank that receives the result, or None for every rank.
    """
    top = group.all_reduce(partial.top.detach().clone(), dist.ReduceOp.MAX)  # the output does not depend on it
    scale = torch.where(torch.isinf(partial.top), torch.zeros_like(top), torch.exp(partial.top - top))
    packed = torch.cat([(partial.total * scale)[..., None], partial.weighted * scale[..., None]], dim=-1)
    packed = group.all_reduce(packed, dist.ReduceOp.SUM) if dst is None else group.reduce(packed, dst)
    return packed[..., 1:] / packed[..., :1]


def local_top_n(scores, top_n, first_block):
    """scores (b, g, T, m) of this rank's blocks (first global id first_block) -> (scores, global ids)
    (b, g, T, top_n), best first, ties to the lower id, padded with -inf."""
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    ordered, order = ordered[..., :top_n], order[..., :top_n] + first_block
    missing = top_n - ordered.shape[-1]
    if missing:
        ordered = torch.nn.functional.pad(ordered, (0, missing), value=NEG_INF)
        order = torch.nn.functional.pad(order, (0, missing))
    return ordered, order


def local_selection(retriever, group_queries, summaries, limits, top_n, first_block):
    """This rank's top-n of its own blocks: group_queries (b, g, T, e), summaries (b, g, m, e) of the
    rank's blocks, limits (b, T) in 0 .. m -> (scores, global ids) (b, g, T, top_n), as local_top_n.

    An ExactRetriever scores every candidate; any other retriever (HNSW graphs over this rank's
    blocks) picks the blocks, which are then scored exactly so that the ranks' lists merge by score.
    """
    if isinstance(retriever, ExactRetriever):
        return local_top_n(candidate_scores(group_queries, summaries, limits), top_n, first_block)
    ids, valid = retriever.select(group_queries, summaries, limits, top_n)
    b, g, T, n = ids.shape
    chosen = summaries.gather(2, ids.reshape(b, g, T * n, 1).expand(-1, -1, -1, summaries.shape[-1]))
    scores = (chosen.view(b, g, T, n, -1) @ group_queries[..., None].to(chosen.dtype))[..., 0]
    scores = scores.to(group_queries.dtype).masked_fill(~valid, NEG_INF)
    # Ties to the lower id, as local_top_n: order by id, then stably by score.
    ids, by_id = ids.masked_fill(~valid, 0).sort(dim=-1, stable=True)
    scores, order = scores.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return scores, ids.gather(-1, order) + first_block


def global_top_n(gathered_scores, gathered_ids, top_n):
    """(N, b, g, T, n) each rank's local top-n -> (ids, valid) (b, g, T, n): the best n over all ranks,
    ties to the lower block id (rank order is block order, and each rank's list is stable)."""
    scores = torch.cat(gathered_scores.unbind(0), dim=-1)
    ids = torch.cat(gathered_ids.unbind(0), dim=-1)
    best, order = scores.sort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, order[..., :top_n]), best[..., :top_n] > NEG_INF


class ShardedAttention:
    """The attention core of one layer on one rank, in place of AnnAttention (same call signature)."""

    def __init__(self, config, group, shards, tile=PREFILL_TILE, layer=None):
        if config.attn_impl != "ann":
            raise ValueError(f"context parallelism shards ANN attention, got attn_impl={config.attn_impl!r}")
        if config.ann_block_summary == "keys":
            raise ValueError("context parallelism merges per-rank block scores of summaries; ann_block_summary "
                             "'keys' is single-process only")
        self.ann = AnnAttention(config, layer)
        self.group, self.shards, self.tile = group, shards, tile
        self.window, self.block_size, self.kv_heads = config.ann_window, config.ann_block_size, config.num_key_value_heads

    def new_layer_cache(self, reserve=0):
        return self.ann.new_layer_cache(reserve)

    def __call__(self, q, k, v, starts, ends, layer_cache, rope, spans=None):
        """q (1, h, s, d), k/v (1, g, s, d) unrotated, of this rank's new tokens -> out (1, h, s, d).

        Prefill: the rank's own positions lo .. hi-1. Decoding: the same new token on every rank.
        """
        k = self.ann.stored_frame(k, rope)
        rank = self.group.rank
        if self.shards.decoding:
            if rank == self.group.size - 1:
                local = int(starts[0]) - self.shards.base(rank)
                layer_cache.write(k, v, torch.tensor([local]))
                layer_cache.update_summaries(local, local + k.shape[2])
            return self.attend(q, rope.positions, layer_cache, rope, None)
        halo_k, halo_v = self.halo(k, v)
        layer_cache.write(torch.cat([halo_k, k], dim=2), torch.cat([halo_v, v], dim=2), torch.zeros(1, dtype=torch.long))
        with torch.no_grad():  # summaries only rank blocks: the selection carries no gradient
            layer_cache.update_summaries(0, self.shards.hi(rank) - self.shards.base(rank))
        if self.shards.training:
            return self.answer_everyone(q, layer_cache, rope)
        outputs = []
        for src in range(self.group.size):
            lo, hi = self.shards.lo(src), self.shards.hi(src)
            for begin in range(lo, hi, self.tile):
                length = min(self.tile, hi - begin)
                tile = q[:, :, begin - lo : begin - lo + length] if src == rank else q.new_empty(*q.shape[:2], length, q.shape[3])
                self.group.broadcast(tile.contiguous() if src == rank else tile, src)
                positions = (begin + torch.arange(length))[None]
                out = self.attend(tile, positions, layer_cache, rope, src)
                if src == rank:
                    outputs.append(out)
        return torch.cat(outputs, dim=2) if outputs else q

    def answer_everyone(self, q, layer_cache, rope):
        """Training: q (1, h, s, d) unrotated, of this rank's positions -> out (1, h, s, d).

        Every rank's queries (1, h, T, d) are gathered and answered in one tile, so that every rank
        runs the same collectives and each of them stays in every rank's autograd graph.
        """
        shards, rank = self.shards, self.group.rank
        lengths = [shards.hi(src) - shards.lo(src) for src in range(self.group.size)]
        gathered = self.group.all_gather(torch.nn.functional.pad(q, (0, 0, 0, max(lengths) - q.shape[2])))
        everyone = torch.cat([gathered[src][:, :, :length] for src, length in enumerate(lengths)], dim=2)
        out = self.attend(everyone, torch.arange(everyone.shape[2])[None], layer_cache, rope, None)
        return out[:, :, shards.lo(rank) : shards.hi(rank)]

    def halo(self, k, v):
        """The stored keys and values of positions base .. lo-1 (a block begun on earlier ranks), (1, g, <B, d)."""
        rank, shards = self.group.rank, self.shards
        return tuple(
            rows.narrow(2, rows.shape[2] - (shards.lo(rank) - shards.base(rank)), shards.lo(rank) - shards.base(rank))
            for rows in preceding_rows(self.group, shards, torch.cat([k, v], dim=-1), self.block_size - 1).split(
                k.shape[-1], dim=-1
            )
        )

    def attend(self, q, positions, layer_cache, rope, dst):
        """Unrotated q (1, h, T, d) at positions (1, T) -> (1, h, T, d) on rank dst (None: every rank)."""
        b, h, tile_len, d = q.shape
        if self.ann.logn_length:  # reads the last position only where queries may be scaled
            q = self.ann.logn_queries(q, positions, int(positions[0, -1]))
        window_q, block_q = self.ann.query_frames(q * (1.0 / math.sqrt(d)), rope.moved(positions))
        token_major = (b, self.kv_heads, h // self.kv_heads, tile_len, d)
        window_logits, window_values = self.window_part(window_q.view(token_major).transpose(2, 3), positions, layer_cache, rope)
        logits, values = [window_logits], [window_values]
        blocks = self.selected_blocks(block_q, positions, layer_cache)
        if blocks is not None:
            logits.append(block_q.view(token_major).transpose(2, 3) @ blocks.keys.transpose(-1, -2))
            logits[-1].masked_fill_(~blocks.visible[:, :, :, None], NEG_INF)
            values.append(blocks.values)
        softmax_dtype = torch.promote_types(q.dtype, torch.float32)
        parts = [partial_attention(part.to(softmax_dtype), value.to(softmax_dtype)) for part, value in zip(logits, values)]
        out = merge_partials(self.group, combine(parts), dst)
        return out.to(q.dtype).transpose(2, 3).reshape(b, h, tile_len, d)

    def window_part(self, window_q, positions, layer_cache, rope):
        """window_q (1, g, T, r, d) -> (logits (1, g, T, r, L), values (1, g, 1, L, d)) over the window keys
        this rank owns (L may be 0)."""
        rank, shards = self.group.rank, self.shards
        first = max(shards.lo(rank), int(positions[0, 0]) - self.window + 1)
        end = min(shards.hi(rank), int(positions[0, -1]) + 1)
        end = max(first, end)
        base = shards.base(rank)
        key_positions = torch.arange(first, end)[None]
        if end > first:
            keys, values = layer_cache.k[:, :, first - base : end - base], layer_cache.v[:, :, first - base : end - base]
        else:
            keys = values = window_q.new_zeros(1, self.kv_heads, 0, window_q.shape[-1])
        if self.ann.capped:
            keys = rope.at(keys, key_positions)
        b, g, tile_len, r, d = window_q.shape
        logits = (window_q.reshape(b, g, tile_len * r, d) @ keys.transpose(-1, -2)).view(b, g, tile_len, r, -1)
        distance = positions[0, :, None] - key_positions[0, None, :]  # (T, L)
        hidden = (distance < 0) | (distance >= self.window)
        logits.masked_fill_(hidden[None, None, :, None, :], NEG_INF)
        return logits, values[:, :, None]

    def selected_blocks(self, block_q, positions, layer_cache):
        """The global top-n blocks of each query that this rank owns, gathered: RetrievedBlocks, or None."""
        top_n = min(self.ann.top_n, int(candidate_count(positions[:, -1:], self.window, self.block_size)))
        if not top_n:
            return None
        rank, shards = self.group.rank, self.shards
        first_block, end_block = shards.blocks(rank)
        owned = end_block - first_block
        group_queries = selection_queries(block_q.detach(), self.kv_heads, self.ann.summary)
        limits = (candidate_count(positions, self.window, self.block_size) - first_block).clamp(0, owned)
        summaries = group_queries.new_zeros(*group_queries.shape[:2], 0, group_queries.shape[-1])
        if owned:
            summaries = layer_cache.summaries[:, :, :owned]
        with torch.no_grad():
            scores, ids = local_selection(layer_cache.retriever, group_queries, summaries, limits, top_n, first_block)
            packed = self.group.all_gather(torch.stack([scores.double(), ids.double()]))
            ids, valid = global_top_n(packed[:, 0], packed[:, 1].long(), top_n)
            mine = valid & (ids >= first_block) & (ids < end_block)
        if not owned or not bool(mine.any()):
            return None
        base = shards.base(rank)
        length = shards.hi(rank) - base
        tables = block_tables(layer_cache.k[:, :, :length], layer_cache.v[:, :, :length], self.block_size)
        return tables.gather((ids - first_block).clamp(0, owned - 1), mine, positions - base, self.window)


def combine(parts):
    """Partials over disjoint key sets of the same queries -> one Partial (the same log-sum-exp rule)."""
    top = torch.stack([part.top for part in parts]).amax(dim=0)
    total, weighted = 0, 0
    for part in parts:
        scale = torch.where(torch.isinf(part.top), torch.zeros_like(top), torch.exp(part.top - top))
        total = total + part.total * scale
        weighted = weighted + part.weighted * scale[..., None]
    return Partial(top, total, weighted)


def preceding_rows(group, shards, rows, count):
    """rows (1, x, s, c) of this rank's positions -> (1, x, count', c): the last count' = min(count, lo)
    rows of the positions before this rank's, from the ranks before it (one all_gather of every
    rank's last `count` rows)."""
    everything = tails(group, shards, rows, count)
    before = torch.cat(everything[: group.rank], dim=2) if group.rank else rows[:, :, :0]
    return before[:, :, max(0, before.shape[2] - count) :]


def tails(group, shards, rows, count):
    """[each rank's last min(count, its length) rows (1, x, ., c)], in rank order: one all_gather."""
    kept = rows[:, :, max(0, rows.shape[2] - count) :]
    padded = torch.nn.functional.pad(kept, (0, 0, 0, count - kept.shape[2]))
    gathered = group.all_gather(padded)
    lengths = [min(count, shards.hi(rank) - shards.lo(rank)) for rank in range(group.size)]
    return [gathered[rank][:, :, :length] for rank, length in enumerate(lengths)]


class ContextParallelLM:
    """A MiniMindForCausalLM whose attention over one sequence is sharded over a ShardGroup.

    The model's attention cores are replaced in place by ShardedAttention cores. prefill(local_ids,
    bounds) takes this rank's part of the prompt; decode(token) the next token, on every rank.
    """

    def __init__(self, model, group, bounds, tile=PREFILL_TILE):
        config = model.config
        self.model, self.group = model, group
        if len(bounds) != group.size + 1:
            raise ValueError(f"{group.size} ranks need {group.size + 1} shard bounds, got {len(bounds)}")
        self.shards = Shards(bounds, config.ann_block_size)
        self.cores = [
            ShardedAttention(config, group, self.shards, tile, layer) for layer in range(len(model.model.layers))
        ]
        for layer, core in zip(model.model.layers, self.cores):
            layer.self_attn.core = core
        self.caches = [core.new_layer_cache() for core in self.cores]
        self.num_shifted = model.model.layers[0].self_attn.num_shifted

    def prefill(self, local_ids, last_only=False):
        """local_ids (1, hi - lo) of this rank's positions -> logits (1, hi - lo, vocab), or (1, 1, vocab)
        of the rank's last position with last_only (a long prompt's logits would not fit)."""
        self.check_length(local_ids)
        with torch.no_grad():  # inference: the reduce onto each tile's owner carries no gradient
            return self.run_layers(local_ids, self.shards.lo(self.group.rank), last_only)

    def stream(self, local_ids, max_new_tokens, choose=None):
        """Yield the continuation of the sharded prompt (local_ids as prefill's) one token id at a time,
        the same on every rank. choose(logits (1, vocab)) -> (1, 1) token (default: greedy) runs on
        rank 0, which broadcasts its choice, so sampled tokens are draws of rank 0's random generator
        alone, as in one process. Stopping reading stops decoding."""
        choose = choose or (lambda logits: logits.argmax(-1, keepdim=True))
        logits = self.prefill(local_ids, last_only=True)  # (1, 0, vocab) on a rank holding no position
        holding = [rank for rank in range(self.group.size) if self.shards.hi(rank) > self.shards.lo(rank)]
        owner = holding[-1]  # holds the prompt's last position; decoded logits are on every rank
        if owner != 0:
            buffer = logits[:, -1] if self.group.rank == owner else logits.new_empty(1, logits.shape[-1])
            logits = self.group.broadcast(buffer.contiguous(), owner)[:, None]
        logits = logits[:, -1] if self.group.rank == 0 else None
        for step in range(max_new_tokens):
            token = choose(logits) if self.group.rank == 0 else torch.zeros(1, 1, dtype=torch.long)
            self.group.broadcast(token, 0)
            yield int(token)
            if step + 1 < max_new_tokens:
                logits = self.decode(token)[:, -1]

    def greedy(self, local_ids, max_new_tokens, end_ids=()):
        """Greedy continuation of the sharded prompt (local_ids as prefill's) -> (new token ids, seconds
        to the first), the same on every rank. Stops before an end id or after max_new_tokens."""
        start = time.perf_counter()
        new_ids, first_token_s = [], None
        for token in self.stream(local_ids, max_new_tokens):
            if first_token_s is None:
                first_token_s = time.perf_counter() - start
            if token in end_ids:
                break
            new_ids.append(token)
        return new_ids, first_token_s

    def check_length(self, local_ids):
        rank = self.group.rank
        if local_ids.shape[1] != self.shards.hi(rank) - self.shards.lo(rank):
            raise ValueError(f"rank {rank} holds {self.shards.hi(rank) - self.shards.lo(rank)} positions, got {local_ids.shape[1]} ids")

    def train_step(self, local_ids):
        """local_ids (1, hi - lo) of this rank's positions -> the whole sequence's mean next-token loss
        (float, the same on every rank). Sets every parameter's .grad to the whole sequence's gradient,
        the same on every rank (the model's caches are rebuilt: prefill again before decoding)."""
        group = self.group
        self.check_length(local_ids)
        self.model.zero_grad(set_to_none=True)
        self.caches = [core.new_layer_cache() for core in self.cores]
        self.shards.training = True
        try:
            logits = self.run_layers(local_ids, self.shards.lo(group.rank))
        finally:
            self.shards.training = False
        targets = self.targets(local_ids)
        loss_sum = torch.nn.functional.cross_entropy(logits[0].float(), targets, ignore_index=IGNORE, reduction="sum")
        with torch.no_grad():
            totals = group.all_reduce(torch.stack([loss_sum.double(), (targets != IGNORE).sum().double()]), dist.ReduceOp.SUM)
        # Each rank holds a copy of the mean loss; backpropagating every copy would count it N times,
        # so each rank backpropagates its own positions' share and the gradients are summed (as DDP does).
        outputs, group.outputs = group.outputs, []
        roots = [loss_sum / totals[1].to(loss_sum.dtype), *outputs]
        torch.autograd.backward(roots, [torch.ones_like(roots[0]), *map(torch.zeros_like, outputs)])
        self.sum_gradients()
        return float(totals[0] / totals[1])

    def targets(self, local_ids):
        """local_ids (1, s) -> (s,) each position's next token: the last one's is the first token of the
        next rank holding any (IGNORE at the sequence's end; one all_gather of every rank's first id)."""
        with torch.no_grad():
            firsts = self.group.all_gather(local_ids[0, :1] if local_ids.shape[1] else torch.full((1,), IGNORE))
        later = [int(token) for token in firsts.flatten()[self.group.rank + 1 :] if token != IGNORE]
        if not local_ids.shape[1]:
            return local_ids[0]
        return torch.cat([local_ids[0, 1:], torch.tensor([later[0] if later else IGNORE])])

    def sum_gradients(self):
        """Every parameter's .grad becomes the sum over ranks (one all_reduce of them all, flattened)."""
        parameters = [parameter for parameter in self.model.parameters() if parameter.requires_grad]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]
        with torch.no_grad():
            flat = self.group.all_reduce(torch.cat([grad.flatten() for grad in grads]), dist.ReduceOp.SUM)
        for parameter, summed in zip(parameters, flat.split([p.numel() for p in parameters])):
            parameter.grad = summed.view_as(parameter).clone()

    def decode(self, token):
        """token (1, 1), the same on every rank -> logits (1, 1, vocab), the same on every rank."""
        self.shards.decoding = True
        self.shards.grow(1)
        with torch.no_grad():
            return self.run_layers(token, self.shards.hi(self.group.size - 1) - 1)

    def run_layers(self, ids, first_position, last_only=False):
        model, config = self.model, self.model.config
        x = model.model.embed_tokens(ids)
        s = ids.shape[1]
        starts = torch.tensor([first_position])
        rope = Rope((first_position + torch.arange(s))[None], config.head_dim, config.rope_theta, x.dtype)
        for layer, cache in zip(model.model.layers, self.caches):
            shifted = None
            if self.num_shifted and not self.shards.decoding:
                shifted = [layer.input_layernorm(part) for part in self.shift_inputs(x)]
                cache.last_inputs = shifted[0]
            x = layer(x, rope, starts, starts + s, cache)
            if shifted is not None:
                cache.last_inputs = shifted[1]  # decoding continues from the sequence's last tokens
        return model.lm_head(model.model.norm(x[:, -1:] if last_only else x))

    def shift_inputs(self, x):
        """x (1, s, c) -> (the num_shifted inputs before this rank's first position, the sequence's last
        num_shifted inputs), each (1, num_shifted, c), zeros before position 0 (token shift)."""
        count = self.num_shifted
        everything = tails(self.group, self.shards, x[:, None], count)  # positions on dim 2, as tails() takes them
        zeros = x.new_zeros(1, 1, count, x.shape[-1])
        before, last = torch.cat([zeros, *everything[: self.group.rank]], dim=2), torch.cat([zeros, *everything], dim=2)
        return before[:, 0, -count:], last[:, 0, -count:]
