"""HNSW block retrieval: maximum-inner-product search over block summaries with FAISS graphs.

`HnswRetriever` speaks model/retrieval.py's interface (`select`); `MipsHnsw` is one growing graph.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np
import torch


def with_rows(array, needed, fill):
    """array (capacity, ...) with room for `needed` rows: doubled, new rows set to fill."""
    if len(array) >= needed:
        return array
    grown = np.full((max(needed, 2 * len(array), 16), *array.shape[1:]), fill, dtype=array.dtype)
    grown[: len(array)] = array
    return grown


class MipsHnsw:
    """Maximum-inner-product search over one growing set of vectors with an L2 HNSW graph.

    Vectors are inserted one at a time, in order, and everything below (radius, rebuilds, merged
    duplicates, orphans) is decided per vector: the state after inserting x_0 .. x_{L-1} is a
    function of those vectors alone, however the insertions were split into calls, and of no
    thread count (FAISS inserts a batch in parallel, in an order that depends on the threads).

    HNSW walks a graph built for a metric; inner product is not one, and searching it directly
    loses recall. The standard reduction appends sqrt(R^2 - |x|^2) to every stored vector and 0 to
    every query: then the L2-nearest stored vector is the one of largest inner product, for any
    R >= max |x|. R is fixed per graph; a vector longer than R rebuilds the graph with R doubled,
    which happens O(log(norm growth)) times.

    Near-duplicates share one graph node. Repetitive text makes thousands of blocks with the same
    summary (up to float rounding); as separate nodes they fill each other's neighbour lists and cut
    the graph into cliques that a search cannot leave (recall of a distinct block among 4k
    duplicated filler blocks fell to 3/20). A vector within DUPLICATE_TOLERANCE * R of a node's
    vector joins that node; a search expands a node into its members in insertion order (equal
    scores, any is right).

    Nodes that no other node links to are scored exactly. HNSW's neighbour pruning can drop every
    edge into a vector unlike its neighbours, and no search reaches such a node however wide; among
    repeated filler, that is the distinct block a query looks for (the passkey's, measured: 20 of
    300 queries missed it with efSearch 512 over 156 nodes). Orphans are few, so scoring them is
    cheap. They are found from in-degrees kept up to date per `add`: inserting a node rewrites only
    its own level-0 neighbour list and the lists of the nodes it links to (at most 2M + 1 lists), so
    only the lists so rewritten during the call are re-read, once each, at its end.
    """

    DUPLICATE_TOLERANCE = 1e-4
    # The duplicate check asks for the one node nearest a vector that is (nearly) on it: a narrow
    # search finds it, at half the cost of the ef_search that top-k queries need.
    DUPLICATE_EF_SEARCH = 16
    # Members of one node a search can return; a search for k asks for k nodes, so k never needs more.
    MAX_EXPANSION = 8

    def __init__(self, dim, m, ef_construction, ef_search):
        self.dim = dim
        self.m = m
        self.ef_construction = ef_construction
        self.ef_search = ef_search
        self.count = 0  # vectors inserted
        self.node_count = 0
        # Arrays below have spare capacity; rows past count / node_count are unused.
        self.vectors = np.zeros((0, dim), dtype=np.float32)
        self.node_rows = np.zeros(0, dtype=np.int64)  # graph node -> its first vector
        self.members = np.zeros((0, self.MAX_EXPANSION), dtype=np.int32)  # node -> vectors, -1 padded
        self.member_counts = np.zeros(0, dtype=np.int64)
        self.links = np.zeros((0, 2 * m), dtype=np.int32)  # node -> its level-0 neighbours, as the index holds them
        self.slots = np.arange(2 * m)
        # node -> where its level-0 list starts in the index's neighbour array. FAISS appends a new
        # node's lists there, level 0 first, so the start is the array's length before the insertion;
        # keeping it here spares a view of the index's offsets per insertion.
        self.list_starts = np.zeros(0, dtype=np.int64)
        self.neighbor_slots = 0  # length of the index's neighbour array
        # Nodes linked, and their level-0 lists as inserted, since the lists were last re-read.
        self.linked_since_settled, self.rewritten_lists = [], []
        self.in_degree = np.zeros(0, dtype=np.int64)  # node -> level-0 lists holding it
        self.unlinked = set()  # nodes of in-degree 0, kept per add: a scan per search is O(nodes)
        self.orphan_table = None  # (orphan nodes, their vectors) until the next insertion: many searches read it
        self.radius = 0.0
        self.index = None
        self.duplicate_search = faiss.SearchParametersHNSW()
        self.duplicate_search.efSearch = min(self.DUPLICATE_EF_SEARCH, ef_search)
        # Per-insertion buffers, handed to FAISS's C calls: the Python wrappers' checks cost as much
        # as a search of a small graph.
        self.lifted = np.empty((1, dim + 1), dtype=np.float32)
        self.nearest_distance = np.empty((1, 1), dtype=np.float32)
        self.nearest_node = np.empty((1, 1), dtype=np.int64)
        self.buffer_pointers = [faiss.swig_ptr(buffer) for buffer in (self.lifted, self.nearest_distance, self.nearest_node)]

    def __len__(self):
        return self.count

    def _new_index(self):
        index = faiss.IndexHNSWFlat(self.dim + 1, self.m)
        index.hnsw.efConstruction = self.ef_construction
        index.hnsw.efSearch = self.ef_search
        return index

    def _augment(self, vectors):
        lift = np.sqrt(np.maximum(self.radius**2 - (vectors**2).sum(axis=1), 0.0)).astype(np.float32)
        return np.concatenate([vectors, lift[:, None]], axis=1)

    def add(self, vectors):
        """Insert vectors (n, d), one at a time in order."""
        vectors = np.asarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        self.vectors = with_rows(self.vectors, self.count + len(vectors), 0.0)
        for vector in vectors:
            self._insert(vector)
        self._settle_links()

    def _insert(self, vector):
        row = self.count
        self.vectors[row] = vector
        self.count += 1
        squared_norm = float(np.dot(vector, vector))
        if self.index is None or squared_norm > self.radius**2:
            self.radius = max(2.0 * self.radius, np.sqrt(squared_norm) * 1.25, 1e-6)
            self._rebuild()
        lifted = self.lifted
        lifted[0, :-1] = vector
        lifted[0, -1] = np.sqrt(max(self.radius**2 - squared_norm, 0.0))
        node = self._duplicate_of()
        if node < 0:
            node = self._new_node(row, lifted)
        count = self.member_counts[node]
        if count < self.MAX_EXPANSION:
            self.members[node, count] = row
        self.member_counts[node] = count + 1

    def _duplicate_of(self):
        """The node whose vector lies within the tolerance of the lifted vector in self.lifted, or -1."""
        if self.node_count == 0:
            return -1
        lifted_pointer, distance_pointer, node_pointer = self.buffer_pointers
        self.index.search_c(1, lifted_pointer, 1, distance_pointer, node_pointer, self.duplicate_search)
        close = self.nearest_distance[0, 0] <= (self.DUPLICATE_TOLERANCE * self.radius) ** 2
        return int(self.nearest_node[0, 0]) if close else -1

    def _new_node(self, row, lifted):
        node = self.node_count
        self.node_count += 1
        if node == len(self.node_rows):
            self.node_rows = with_rows(self.node_rows, node + 1, 0)
            self.members = with_rows(self.members, node + 1, -1)
            self.member_counts = with_rows(self.member_counts, node + 1, 0)
            self.links = with_rows(self.links, node + 1, -1)
            self.list_starts = with_rows(self.list_starts, node + 1, 0)
            self.in_degree = with_rows(self.in_degree, node + 1, 0)
        self.node_rows[node] = row
        self._link(node, lifted)
        return node

    def _rebuild(self):
        """A fresh index at the current radius, holding the nodes, inserted again in node order."""
        self.index = self._new_index()
        self.hnsw = self.index.hnsw
        self.links[:] = -1
        self.in_degree[:] = 0
        self.neighbor_slots = 0
        self.unlinked.clear()
        self.orphan_table = None
        self.linked_since_settled, self.rewritten_lists = [], []
        for node in range(self.node_count):
            self._link(node, self._augment(self.vectors[self.node_rows[node]][None]))

    def _link(self, node, lifted):
        """Insert node (its lifted vector (1, d+1)) into the index and note the level-0 lists this
        rewrote, its own and those of the nodes it links to, for _settle_links."""
        start = self.list_starts[node] = self.neighbor_slots
        self.index.add_c(1, faiss.swig_ptr(lifted))
        neighbors = self._neighbors()
        self.neighbor_slots = len(neighbors)
        self.linked_since_settled.append(node)
        # A copy: the next insertion may move the array. The list as inserted names the nodes whose
        # lists got the back link, even if a later insertion prunes them from it.
        self.rewritten_lists.append(neighbors[start : start + len(self.slots)].copy())

    def _settle_links(self):
        """Re-read, once each, the level-0 lists rewritten since the last call: the in-degrees and
        orphans then match the graph as if each insertion had re-read its own."""
        if not self.linked_since_settled:
            return
        linked = np.array(self.linked_since_settled, dtype=np.int64)
        nodes = np.unique(np.concatenate([linked, *self.rewritten_lists]))
        self.linked_since_settled, self.rewritten_lists = [], []
        self._reread(nodes[nodes >= 0], self._neighbors(), linked)

    def _neighbors(self):
        """The index's neighbour lists, as a view: copying them per insertion would cost O(nodes)."""
        return faiss.rev_swig_ptr(self.hnsw.neighbors.data(), self.hnsw.neighbors.size())

    def reread_links(self, nodes):
        """Refresh the copies of these nodes' level-0 lists and the in-degrees they count toward."""
        self._reread(nodes, self._neighbors(), nodes)

    def _reread(self, nodes, neighbors, new_nodes):
        """Re-read nodes' level-0 lists; new_nodes (among them) may have no in-link yet."""
        old = self.links[nodes]
        new = neighbors[self.list_starts[nodes][:, None] + self.slots]
        changed = new != old  # mostly one slot per list: the new node's back link
        gained, lost = new[changed], old[changed]
        gained, lost = gained[gained >= 0], lost[lost >= 0]
        np.add.at(self.in_degree, gained, 1)
        np.subtract.at(self.in_degree, lost, 1)
        self.links[nodes] = new
        # Only these can have become (un)linked: the nodes whose in-degree moved, and new ones.
        touched = np.concatenate([new_nodes, gained, lost])
        is_unlinked = self.in_degree[touched] == 0
        self.unlinked.update(touched[is_unlinked].tolist())
        self.unlinked.difference_update(touched[~is_unlinked].tolist())
        self.orphan_table = None

    def orphans(self):
        """(nodes, vectors (len(nodes), d)): the graph nodes that no node's level-0 neighbour list
        holds, except the entry point, in node order, and their vectors."""
        if self.orphan_table is None:
            nodes = np.array(sorted(self.unlinked - {self.hnsw.entry_point}), dtype=np.int64)
            self.orphan_table = (nodes, self.vectors[self.node_rows[nodes]])
        return self.orphan_table

    def search(self, queries, k):
        """queries (s, d) -> labels (s, k) int64: insertion positions of the vectors with the
        largest inner products (-1 where fewer than k vectors exist)."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        k = min(k, self.count)
        if k == 0:
            return np.full((len(queries), 0), -1, dtype=np.int64)
        augmented = np.concatenate([queries, np.zeros((len(queries), 1), dtype=np.float32)], axis=1)
        distances, nodes = self.index.search(augmented, min(k, self.node_count))
        orphans, orphan_vectors = self.orphans()
        if len(orphans):
            nodes = self._with_orphans(queries, distances, nodes, orphans, orphan_vectors, k)
        firsts = np.where(nodes >= 0, self.node_rows[np.maximum(nodes, 0)], -1)
        if self.node_count == self.count:  # no merged duplicates: each node is one vector
            return firsts
        # Rows that found only single-member nodes, k of them, are their nodes' first vectors.
        expand = (self.member_counts[np.maximum(nodes, 0)] > 1).any(axis=1) | (nodes.shape[1] < k)
        if not expand.any():
            return firsts
        labels = np.full((len(queries), k), -1, dtype=np.int64)
        if not expand.all():  # then every row found k nodes
            labels[~expand] = firsts[~expand]
        nodes = nodes[expand]
        candidates = np.where(nodes[..., None] >= 0, self.members[np.maximum(nodes, 0)], -1).reshape(len(nodes), -1)
        # Keep the first k real members of each row, in order.
        order = np.argsort(candidates < 0, axis=1, kind="stable")[:, :k]
        labels[expand] = np.take_along_axis(candidates, order, axis=1)
        return labels

    def _with_orphans(self, queries, distances, nodes, orphans, orphan_vectors, k):
        """The graph's nodes (s, k') and their distances, plus the orphans -> the best k nodes (s, k)."""
        # |q - x'|^2 = |q|^2 + R^2 - 2 q.x for a lifted x', so the graph's distances give its inner products.
        found_scores = ((queries**2).sum(axis=1, keepdims=True) + self.radius**2 - distances) / 2
        orphan_scores = queries @ orphan_vectors.T
        if nodes.shape[1] == k and (nodes >= 0).all() and (orphan_scores.max(axis=1) <= found_scores[:, -1]).all():
            return nodes  # no orphan beats the graph's k-th: the merge below would keep the graph's answer
        orphan_scores[(nodes[:, :, None] == orphans).any(axis=1)] = -np.inf  # the graph found it too
        nodes = np.concatenate([nodes, np.broadcast_to(orphans, orphan_scores.shape)], axis=1)
        scores = np.concatenate([found_scores, orphan_scores], axis=1)
        scores[nodes < 0] = -np.inf
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(nodes, order, axis=1)


def run_per_head(serve, heads, parallel=True):
    """serve(head) for each head, on up to torch.get_num_threads() threads (parallel), or in turn on
    the calling thread (not parallel: a step that only searches one query per graph costs less
    than handing it to a worker and back).

    FAISS releases the GIL in add and search and each kv head has graphs of its own, so heads run
    side by side; within a worker FAISS runs single-threaded (OpenMP's thread count is per calling
    thread), so the workers do not oversubscribe the cores. A graph's calls stay in one thread, in
    order: the answer is the same for any thread count.
    """
    workers = min(heads, torch.get_num_threads()) if parallel else 1
    if workers <= 1:
        for head in range(heads):
            serve(head)
        return
    if workers not in HEAD_WORKERS:
        HEAD_WORKERS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="hnsw-head")

    def serve_alone(head):
        faiss.omp_set_num_threads(1)
        serve(head)

    list(HEAD_WORKERS[workers].map(serve_alone, range(heads)))


HEAD_WORKERS = {}  # thread count -> pool, made once per process
os.register_at_fork(after_in_child=HEAD_WORKERS.clear)  # a forked child has none of the pools' threads


class HnswRetriever:
    """One MipsHnsw per (sequence, kv head), holding blocks 0 .. L-1 of its sequence in block order.

    Causal: a query with L candidate blocks searches its graphs when they hold exactly blocks
    0 .. L-1, so its answer depends on those blocks alone, not on later ones nor on how a prefill
    was split into calls (the graph after L insertions is one state). A call takes its queries in
    increasing L, growing the graphs between groups; labels are insertion positions, i.e. block ids.
    Each kv head's graph is served on its own thread (run_per_head).
    """

    vectors_per_block = 1

    def __init__(self, m, ef_construction, ef_search):
        self.settings = (m, ef_construction, ef_search)
        self.graphs = None

    def held_blocks(self, graph):
        return len(graph) // self.vectors_per_block

    def stored_blocks(self, row):
        return self.held_blocks(self.graphs[row][0])

    def search(self, graph, queries, top_n):
        """queries (s, e) of one kv head -> block ids (s, <=n), -1 where fewer blocks exist."""
        return graph.search(queries, top_n)

    def summaries_changed(self, first_block):
        """The KV cache recomputed blocks first_block on: a graph keeps the vectors it was given, as a
        sequence's candidates never shrink (select refuses a query that would see fewer blocks)."""

    def _check_batch(self, summaries):
        b, g = summaries.shape[:2]
        if self.graphs is None:
            dim = summaries.shape[-1]
            self.graphs = [[MipsHnsw(dim, *self.settings) for _ in range(g)] for _ in range(b)]
        if len(self.graphs) != b:
            raise ValueError(f"this HNSW state holds {len(self.graphs)} sequences, the call has {b}")

    def add_candidates(self, summaries, limits):
        """Grow each sequence's graphs to its largest limit: blocks up to it, in block order."""
        self._check_batch(summaries)
        for row, limit in enumerate(limits.max(dim=1).values.tolist()):
            blocks = summaries[row, :, self.stored_blocks(row) : limit].detach().float().cpu().numpy()
            for graph, vectors in zip(self.graphs[row], blocks):
                graph.add(vectors.reshape(-1, blocks.shape[-1]))

    def select(self, group_queries, summaries, limits, top_n, bounds=None):
        """group_queries (b, g, s, e), summaries (b, g, m, e), limits (b, s) -> ids, valid (b, g, s, n).

        bounds is unused: the search reads every limit on the host anyway."""
        self._check_batch(summaries)
        b, g, s = group_queries.shape[:3]
        block_ids = np.zeros((b, g, s, top_n), dtype=np.int64)
        valid = np.zeros((b, g, s, top_n), dtype=bool)
        if top_n:
            queries = group_queries.detach().float().cpu().numpy()
            for row, row_limits in enumerate(limits.cpu().numpy()):
                self._select_row(row, queries[row], summaries, row_limits, block_ids[row], valid[row])
        device = group_queries.device
        return torch.from_numpy(block_ids).to(device), torch.from_numpy(valid).to(device)

    def _select_row(self, row, queries, summaries, limits, block_ids, valid):
        """One sequence: queries (g, s, e), limits (s,) -> fills block_ids and valid (g, s, n)."""
        order = np.argsort(limits, kind="stable")
        group_limits, group_starts = np.unique(limits[order], return_index=True)
        groups = [(int(limit), picked) for limit, picked in zip(group_limits, np.split(order, group_starts[1:])) if limit]
        if not groups:
            return
        stored = self.stored_blocks(row)
        if groups[0][0] < stored:
            raise ValueError(
                f"the HNSW graphs of sequence {row} hold {stored} blocks and a query has {groups[0][0]} "
                "candidates: it would see later blocks (a sequence's limits may not decrease from call to call)"
            )
        new_blocks = summaries[row, :, stored : groups[-1][0]].detach().float().cpu().numpy()

        def serve(head):
            graph = self.graphs[row][head]
            for limit, picked in groups:
                added = new_blocks[head, self.held_blocks(graph) - stored : limit - stored]
                graph.add(added.reshape(-1, new_blocks.shape[-1]))
                labels = self.search(graph, queries[head, picked], block_ids.shape[-1])
                found = labels.shape[1]
                block_ids[head, picked, :found] = np.maximum(labels, 0)
                valid[head, picked, :found] = labels >= 0

        run_per_head(serve, len(self.graphs[row]), parallel=new_blocks.shape[1] > 0 or len(limits) > 1)


class KeyHnswRetriever(HnswRetriever):
    """HNSW over keys, for ann_block_summary "keys": HnswRetriever whose graph per (sequence, kv head)
    holds every key of blocks 0 .. L-1 in position order (insertion position // B is the block).

    Each of a query's r heads asks the graph for its keys_per_head best keys; the blocks holding
    them are the candidates, and each candidate gets its exact "keys" score (the sum over the
    heads of each head's best q . k in the block, from the graph's own copy of the keys). The top_n
    by that score are the selection: exact selection's answer whenever each of exact's top_n blocks
    holds a key that some head's search found. Summaries are the blocks' keys (b, g, m, B, d) and
    group queries (b, g, s, r, d).
    """

    def __init__(self, block_size, keys_per_head, m, ef_construction, ef_search):
        super().__init__(m, ef_construction, ef_search)
        self.block_size = block_size
        self.keys_per_head = keys_per_head

    @property
    def vectors_per_block(self):
        return self.block_size

    def search(self, graph, queries, top_n):
        """queries (s, r, d): one token's group of heads per row -> block ids (s, <=n), -1 padded."""
        blocks, scores = self.scored_candidates(graph, queries)
        best = np.argsort(-scores, axis=1, kind="stable")[:, :top_n]
        return np.where(np.take_along_axis(scores, best, axis=1) > -np.inf, np.take_along_axis(blocks, best, axis=1), -1)

    def scored_candidates(self, graph, queries):
        """queries (s, r, d) -> (blocks (s, c), scores (s, c)): each row's distinct blocks holding a
        key that one of its heads found, in block order, and their exact "keys" scores; -1 and -inf
        pad the rows that found fewer."""
        s, r, d = queries.shape
        labels = graph.search(queries.reshape(s * r, d), self.keys_per_head).reshape(s, -1)
        blocks = labels // self.block_size  # -1 (nothing found) stays -1
        blocks.sort(axis=1)
        repeated = blocks < 0
        repeated[:, 1:] |= blocks[:, 1:] == blocks[:, :-1]  # a block found by several keys counts once
        # Each row's distinct blocks first, in block order; columns that no row fills are cut.
        found = blocks.shape[1] - repeated.sum(axis=1)
        width = max(1, int(found.max()))
        blocks = np.take_along_axis(blocks, np.argsort(repeated, axis=1, kind="stable")[:, :width], axis=1)
        padding = np.arange(width) >= found[:, None]
        blocks[padding] = -1
        keys = torch.from_numpy(graph.vectors[: len(graph)]).view(-1, self.block_size * d)
        candidate_keys = keys.index_select(0, torch.from_numpy(np.maximum(blocks, 0)).view(-1)).view(s, -1, d)
        products = torch.bmm(torch.from_numpy(queries), candidate_keys.transpose(1, 2))  # (s, r, c*B)
        # A block's best key per head: max_pool1d is ~3x faster than amax over a (..., c, B) view.
        best = torch.nn.functional.max_pool1d(products.view(s * r, 1, -1), self.block_size)
        scores = best.view(s, r, width).sum(dim=1).numpy()
        scores[padding] = -np.inf
        return blocks, scores
