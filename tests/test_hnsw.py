"""The HNSW retrievers: recall against exact selection, graphs that grow one block at a time in block
order (causal, chunk-invariant), near-duplicate nodes, unreachable nodes scored exactly; and the
graphs over keys that serve "keys" selection."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from model import MiniMindConfig, hnsw
from model.hnsw import HnswRetriever, KeyHnswRetriever, MipsHnsw
from model.retrieval import build_retriever, exact_select
from tests.summaries import recall, selected_sets, structured_summaries


def growing_vectors(count, dim=16, seed=0):
    """Structured vectors whose norms grow (radius rebuilds) with runs of exact repeats (merged nodes)."""
    _, summaries = structured_summaries(count, dim=dim, seed=seed)
    vectors = summaries[0, 0].numpy() * np.linspace(1.0, 6.0, count, dtype=np.float32)[:, None]
    vectors[count // 3 : count // 3 + 40] = vectors[count // 3]
    return vectors


def graph_state(graph):
    used = slice(0, graph.node_count)
    return (graph.radius, graph.node_rows[used].tolist(), graph.members[used].tolist(), graph.links[used].tolist(),
            graph.index.hnsw.entry_point)


def test_hnsw_recall_on_structured_keys_at_the_default_settings():
    config = MiniMindConfig()
    queries, summaries = structured_summaries(2048)
    limits = torch.full((1, 64), 2048)
    exact = selected_sets(*exact_select(queries, summaries, limits, 4))
    retriever = HnswRetriever(config.hnsw_m, config.hnsw_ef_construction, config.hnsw_ef_search)
    hnsw = selected_sets(*retriever.select(queries, summaries, limits, 4))
    assert recall(hnsw, exact) >= 0.95


@pytest.mark.parametrize("num_blocks", [1, 5, 150])
def test_hnsw_selects_the_same_blocks_as_exact_where_its_recall_is_exact(num_blocks):
    queries, summaries = structured_summaries(num_blocks, seed=num_blocks)
    limits = torch.randint(0, num_blocks + 1, (1, 64))
    retriever = HnswRetriever(32, 80, 256)
    assert selected_sets(*retriever.select(queries, summaries, limits, 4)) == selected_sets(
        *exact_select(queries, summaries, limits, 4)
    )


def test_hnsw_grows_incrementally_and_survives_norm_growth():
    queries, summaries = structured_summaries(300)
    summaries[:, :, 200:] *= 3.0  # later blocks longer than the graph's first radius: a rebuild
    retriever = HnswRetriever(32, 80, 256)
    radii = []
    for limit in (10, 120, 300):
        limits = torch.full((1, 64), limit)
        found = selected_sets(*retriever.select(queries, summaries, limits, 4))
        assert recall(found, selected_sets(*exact_select(queries, summaries, limits, 4))) >= 0.95
        radii.append(retriever.graphs[0][0].radius)
    assert radii[2] > radii[1] and retriever.stored_blocks(0) == 300


def test_hnsw_finds_a_distinct_block_among_thousands_of_duplicated_ones():
    """Repetitive text (passkey filler) gives thousands of blocks with one of a few summaries; they
    share graph nodes, so a search still reaches the one block that differs."""
    generator = np.random.default_rng(0)
    phases = generator.normal(size=(29, 16))
    summaries = np.tile(phases, (140, 1)) + 1e-6 * generator.normal(size=(29 * 140, 16))
    key = generator.normal(size=16)
    query = torch.tensor(3 * key + 0.5 * generator.normal(size=16), dtype=torch.float32).expand(1, 1, 1, 16)
    limits = torch.zeros(1, 1, dtype=torch.long)
    for position in generator.choice(len(summaries), 5, replace=False):
        blocks = torch.tensor(np.insert(summaries, position, key, axis=0), dtype=torch.float32)[None, None]
        retriever = HnswRetriever(32, 80, 64)
        for limit in range(256, blocks.shape[2] + 256, 256):  # grows chunk by chunk, like a prefill
            limits[:] = min(limit, blocks.shape[2])
            block_ids, valid = retriever.select(query, blocks, limits, 4)
        exact_best = exact_select(query, blocks, limits, 1)[0][0, 0, 0, 0].item()
        assert valid.all() and block_ids[0, 0, 0, 0].item() == exact_best == position
    assert retriever.graphs[0][0].node_count == 30  # 29 filler summaries and the key


def test_hnsw_scores_graph_nodes_that_no_edge_reaches():
    """HNSW's neighbour pruning can leave a distinct vector with no incoming edge (the passkey's block
    among filler, in a trained model); no search reaches it. Cut every edge into the best block: the
    graph alone misses it, the orphan list finds it, and a block the graph does reach is not doubled."""
    import faiss

    queries, summaries = structured_summaries(200, dim=16)
    vectors, query = summaries[0, 0].numpy(), queries[0, 0, 0].numpy()
    best = int(np.argmax(vectors @ query))
    graph = MipsHnsw(16, 8, 40, 64)
    graph.add(vectors)
    assert len(graph.orphans()[0]) == 0 and graph.search(query[None], 1)[0, 0] == best
    hnsw = graph.index.hnsw
    neighbors = faiss.vector_to_array(hnsw.neighbors)
    neighbors[neighbors == best] = -1  # the node of `best` is itself: no duplicates in these vectors
    faiss.copy_array_to_vector(neighbors, hnsw.neighbors)
    if hnsw.entry_point == best:
        hnsw.entry_point = int(np.argmin(vectors @ query))
    graph.reread_links(np.arange(graph.node_count))
    assert graph.orphans()[0].tolist() == [best]
    _, graph_only = graph.index.search(np.concatenate([query, [0.0]])[None].astype(np.float32), 4)
    assert best not in graph_only[0]
    some_queries = queries[0, 0].numpy()
    found = graph.search(some_queries, 4)
    best_of_each = np.argmax(some_queries @ vectors.T, axis=1)
    assert (found[:, 0] == best_of_each).all() and (best_of_each == best).any() and (best_of_each != best).any()
    assert all(len(set(row)) == len(row) for row in found.tolist())


def test_a_near_duplicate_joins_the_node_within_the_tolerance_of_its_vector():
    """a ~ b and b ~ c within the tolerance, a and c not: b joins a's node, c starts its own (c is
    compared with nodes' vectors, as it would be had a and b come in an earlier call)."""


    base = np.zeros(4, dtype=np.float32)
    base[0] = 10.0
    step = np.array([0, 0.7e-3, 0, 0], dtype=np.float32)  # tolerance is 1e-4 * radius (12.5): 1.25e-3
    vectors = np.stack([base, base + step, base + 2 * step, -base])
    graph = MipsHnsw(4, 8, 40, 64)
    graph.add(vectors)
    assert graph.node_count == 3 and graph.member_counts[:3].tolist() == [2, 1, 1]
    found = graph.search(base[None], 4)[0].tolist()
    assert sorted(found[:3]) == [0, 1, 2] and found[3] == 3
    # One call, one row expanding the merged node and one finding single-member nodes only.
    assert graph.search(np.stack([base, -base]), 1).tolist() == [[0], [3]]


def test_graph_state_does_not_depend_on_how_insertions_are_split_or_on_faiss_threads():
    """The state after L insertions is one state: however the calls split the vectors, and with
    FAISS on 1 or 2 threads (it inserts a batch in parallel)."""
    import faiss


    vectors = growing_vectors(400)
    states, found = [], []
    for splits, threads in [((400,), 1), ((1, 7, 100, 292), 1), ((400,), 2)]:
        graph = MipsHnsw(16, 8, 40, 16)
        previous = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(threads)
        try:
            for part in np.split(vectors, np.cumsum(splits)[:-1]):
                graph.add(part)
        finally:
            faiss.omp_set_num_threads(previous)
        states.append(graph_state(graph))
        found.append(graph.search(vectors[::7], 4))
    assert states[0][0] > 1.25 * np.linalg.norm(vectors[0]) and states[0][1] != list(range(400))  # rebuilt, merged
    assert states[1] == states[0] and states[2] == states[0]
    assert np.array_equal(found[1], found[0]) and np.array_equal(found[2], found[0])


def test_in_degrees_kept_per_insertion_match_a_scan_of_the_whole_graph():
    import faiss


    graph = MipsHnsw(16, 4, 16, 16)  # small M: lists fill up and get pruned, orphans appear
    graph.add(growing_vectors(600))
    hnsw = graph.index.hnsw
    starts = faiss.vector_to_array(hnsw.offsets)[:-1].astype(np.int64)
    linked = faiss.vector_to_array(hnsw.neighbors)[starts[:, None] + np.arange(hnsw.nb_neighbors(0))]
    assert np.array_equal(graph.links[: graph.node_count], linked)
    in_degree = np.bincount(linked[linked >= 0], minlength=len(starts))
    assert np.array_equal(graph.in_degree[: graph.node_count], in_degree)
    expected_orphans = np.flatnonzero(in_degree == 0)
    assert graph.orphans()[0].tolist() == expected_orphans[expected_orphans != hnsw.entry_point].tolist()


def test_orphans_kept_between_insertions_follow_each_insertion():
    """orphans() is kept from one search to the next and made afresh after an insertion."""
    import faiss

    graph = MipsHnsw(16, 4, 16, 16)
    vectors = growing_vectors(900)
    for part in np.split(vectors, [300, 301, 600]):
        graph.add(part)
        nodes, orphan_vectors = graph.orphans()
        assert graph.orphans()[0] is nodes  # kept while nothing was inserted
        hnsw = graph.index.hnsw
        starts = faiss.vector_to_array(hnsw.offsets)[:-1].astype(np.int64)
        linked = faiss.vector_to_array(hnsw.neighbors)[starts[:, None] + np.arange(hnsw.nb_neighbors(0))]
        unlinked = np.flatnonzero(np.bincount(linked[linked >= 0], minlength=len(starts)) == 0)
        assert nodes.tolist() == unlinked[unlinked != hnsw.entry_point].tolist()
        assert np.array_equal(orphan_vectors, graph.vectors[graph.node_rows[nodes]])


def test_hnsw_answer_depends_only_on_the_query_candidates():
    """Blocks past a query's limit can change, and the call can be split anywhere: its answer stays."""
    queries, summaries = structured_summaries(300, seed=4)
    limits = torch.sort(torch.randint(0, 301, (1, 64), generator=torch.Generator().manual_seed(0))).values
    reference = HnswRetriever(4, 16, 8).select(queries, summaries, limits, 4)
    changed = summaries.clone()
    changed[:, :, 150:] = torch.randn(changed[:, :, 150:].shape, generator=torch.Generator().manual_seed(1))
    unchanged = limits[0] <= 150
    answer = HnswRetriever(4, 16, 8).select(queries, changed, limits, 4)
    for got, expected in zip(answer, reference):
        assert torch.equal(got[:, :, unchanged], expected[:, :, unchanged])
    retriever = HnswRetriever(4, 16, 8)
    pieces = [retriever.select(queries[:, :, part], summaries, limits[:, part], 4)
              for part in (slice(0, 1), slice(1, 8), slice(8, 64))]
    for got, expected in zip((torch.cat(parts, dim=2) for parts in zip(*pieces)), reference):
        assert torch.equal(got, expected)


def test_hnsw_refuses_a_limit_below_the_blocks_it_holds():
    queries, summaries = structured_summaries(20)
    retriever = HnswRetriever(32, 80, 64)
    retriever.select(queries, summaries, torch.full((1, 64), 20), 4)
    with pytest.raises(ValueError, match="hold 20 blocks and a query has 12 candidates"):
        retriever.select(queries, summaries, torch.full((1, 64), 12), 4)


def test_hnsw_state_is_tied_to_its_batch():
    queries, summaries = structured_summaries(20)
    retriever = HnswRetriever(32, 80, 64)
    retriever.select(queries, summaries, torch.full((1, 64), 20), 4)
    with pytest.raises(ValueError, match="holds 1 sequences, the call has 2"):
        retriever.select(queries.expand(2, -1, -1, -1), summaries.expand(2, -1, -1, -1), torch.full((2, 64), 20), 4)


def key_blocks(num_blocks, block_size=8, d=16, heads=4, seed=0, repeated=False):
    """Group queries (1, 1, 64, r, d) and block keys (1, 1, m, B, d) for "keys" selection. Keys are
    structured (structured_summaries); repeated: every key of the first half of the blocks is one
    filler key, except one distinct key that the queries point at."""
    _, vectors = structured_summaries(num_blocks * block_size, dim=d, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    queries = vectors[0, 0, torch.randint(0, num_blocks * block_size, (64 * heads,), generator=generator)]
    queries = queries + 0.3 * torch.randn(queries.shape, generator=generator)
    keys = vectors[0, 0].clone()
    if repeated:
        half = num_blocks // 2 * block_size
        keys[:half] = keys[0]
        keys[half // 2] = queries.mean(dim=0) * 4
    return queries.view(1, 1, 64, heads, d), keys.view(1, 1, num_blocks, block_size, d)


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("top_n", [1, 3])
@pytest.mark.parametrize("num_blocks", [1, 7, 60])
def test_key_hnsw_selects_the_same_blocks_as_exact_when_it_finds_every_key(num_blocks, top_n, heads):
    """Asking each head for as many keys as the graph holds makes every block a candidate, so the
    re-scored top_n must be exact selection's (float keys: no ties)."""
    queries, blocks = key_blocks(num_blocks, heads=heads, seed=num_blocks)
    limits = torch.randint(0, num_blocks + 1, (1, 64), generator=torch.Generator().manual_seed(1))
    retriever = KeyHnswRetriever(8, num_blocks * 8, 16, 64, max(64, num_blocks * 8))
    assert selected_sets(*retriever.select(queries, blocks, limits, top_n)) == selected_sets(
        *exact_select(queries, blocks, limits, top_n)
    )


@pytest.mark.parametrize("repeated", [False, True], ids=["structured", "repeated-filler"])
def test_key_hnsw_recall_on_structured_keys(repeated):
    """The four heads of a group here have unrelated queries, so a block that is good for all of them
    need not hold any head's best keys: recall rests on keys_per_head more than on the graph."""
    config = MiniMindConfig(ann_block_summary="keys", ann_retrieval="hnsw", ann_block_size=8, hnsw_keys_per_head=128)
    queries, blocks = key_blocks(600, repeated=repeated, seed=2)
    limits = torch.full((1, 64), 600)
    exact = selected_sets(*exact_select(queries, blocks, limits, 4))
    hnsw = selected_sets(*build_retriever(config).select(queries, blocks, limits, 4))
    assert recall(hnsw, exact) >= 0.95
    if repeated:  # the one distinct key's block is among every query's exact top 4
        assert all(150 in found for found in exact) and sum(150 in found for found in hnsw) >= 0.95 * 64


def test_key_hnsw_answer_depends_only_on_the_query_candidates():
    """As for block summaries: later blocks can change and the call can be split anywhere."""
    queries, blocks = key_blocks(120, seed=5)
    limits = torch.sort(torch.randint(0, 121, (1, 64), generator=torch.Generator().manual_seed(0))).values
    retriever = lambda: KeyHnswRetriever(8, 4, 4, 16, 8)  # noqa: E731
    reference = retriever().select(queries, blocks, limits, 3)
    changed = blocks.clone()
    changed[:, :, 60:] = torch.randn(changed[:, :, 60:].shape, generator=torch.Generator().manual_seed(1))
    unchanged = limits[0] <= 60
    for got, expected in zip(retriever().select(queries, changed, limits, 3), reference):
        assert torch.equal(got[:, :, unchanged], expected[:, :, unchanged])
    split = retriever()
    pieces = [split.select(queries[:, :, part], blocks, limits[:, part], 3) for part in (slice(0, 1), slice(1, 8), slice(8, 64))]
    for got, expected in zip((torch.cat(parts, dim=2) for parts in zip(*pieces)), reference):
        assert torch.equal(got, expected)
    assert split.stored_blocks(0) == int(limits.max()) and len(split.graphs[0][0]) == 8 * int(limits.max())


@pytest.mark.parametrize("keys", [False, True], ids=["blocks", "keys"])
def test_heads_served_on_threads_give_the_one_threaded_answer(monkeypatch, keys):
    """run_per_head serves each kv head's graphs on a thread of its own when torch has threads to
    spare; graphs keep their calls in order, so the answer is the single-threaded one."""
    queries, summaries = key_blocks(80, seed=6) if keys else structured_summaries(300, seed=6)
    queries, summaries = queries.expand(1, 3, *queries.shape[2:]), summaries.expand(1, 3, *summaries.shape[2:])
    limits = torch.sort(torch.randint(0, summaries.shape[2] + 1, (1, 64), generator=torch.Generator().manual_seed(2))).values
    retriever = lambda: KeyHnswRetriever(8, 8, 8, 24, 16) if keys else HnswRetriever(8, 24, 16)  # noqa: E731
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = retriever().select(queries, summaries, limits, 3)
        torch.set_num_threads(3)
        served = []
        monkeypatch.setattr(hnsw, "ThreadPoolExecutor", lambda *args, **kwargs: served.append(args) or ThreadPoolExecutor(*args, **kwargs))
        monkeypatch.setattr(hnsw, "HEAD_WORKERS", {})
        threaded = retriever().select(queries, summaries, limits, 3)
    finally:
        torch.set_num_threads(threads)
    assert served == [(3,)]
    for got, expected in zip(threaded, alone):
        assert torch.equal(got, expected)


def test_search_is_the_graphs_nodes_and_the_orphans_ranked_by_inner_product():
    """Whether or not an orphan enters a row's answer, the answer is the best k of the graph's own
    nodes and the orphans by inner product (a brute-force merge over the same candidates)."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((700, 16)).astype(np.float32)
    graph = MipsHnsw(16, 4, 16, 16)  # small M: orphans appear
    graph.add(vectors)
    orphans, _ = graph.orphans()
    assert len(orphans) and graph.node_count == graph.count
    queries = rng.standard_normal((300, 16)).astype(np.float32)
    queries[:100] = vectors[orphans[rng.integers(len(orphans), size=100)]] * 3  # rows an orphan wins
    k = 4
    found = graph.search(queries, k)
    augmented = np.concatenate([queries, np.zeros((len(queries), 1), dtype=np.float32)], axis=1)
    _, graph_nodes = graph.index.search(augmented, k)
    took_orphan = 0
    for row, query in enumerate(queries):
        candidates = np.union1d(graph_nodes[row][graph_nodes[row] >= 0], orphans)
        scores = vectors[candidates] @ query
        best = np.sort(scores)[::-1][:k]
        np.testing.assert_allclose(np.sort(vectors[found[row]] @ query)[::-1], best, rtol=1e-5, atol=1e-5)
        took_orphan += bool(np.isin(np.setdiff1d(found[row], graph_nodes[row]), orphans).any())
    assert took_orphan >= 50
