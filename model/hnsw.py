"""HNSW block retrieval: maximum-inner-product search over block summaries with FAISS graphs.

`HnswRetriever` speaks model/retrieval.py's interface (`select`); `MipsHnsw` is one growing graph.
"""

import faiss
import numpy as np
import torch


class MipsHnsw:
    """Maximum-inner-product search over one growing set of vectors with an L2 HNSW graph.

    HNSW walks a graph built for a metric; inner product is not one, and searching it directly
    loses recall. The standard reduction appends sqrt(R^2 - |x|^2) to every stored vector and 0 to
    every query: then the L2-nearest stored vector is the one of largest inner product, for any
    R >= max |x|. R is fixed per graph; a vector longer than R rebuilds the graph with R doubled,
    which happens O(log(norm growth)) times.

    Near-duplicates share one graph node. Repetitive text makes thousands of blocks with the same
    summary (up to float rounding); as separate nodes they fill each other's neighbour lists and cut
    the graph into cliques that a search cannot leave (recall of a distinct block among 4k
    duplicated filler blocks fell to 3/20). A vector within DUPLICATE_TOLERANCE * R of a node joins
    it; a search expands a node into its members in insertion order (equal scores, any is right).

    Nodes that no other node links to are scored exactly. HNSW's neighbour pruning can drop every
    edge into a vector unlike its neighbours, and no search reaches such a node however wide; among
    repeated filler, that is the distinct block a query looks for (the passkey's, measured: 20 of
    300 queries missed it with efSearch 512 over 156 nodes). Orphans are few, so scoring them is
    cheap; finding them rescans every level-0 neighbour list after each insertion, O(nodes * 2M)
    (7 ms at 8192 nodes; a 64k-token passkey trial went from 6.5 to 7.1 s, docs/LONG_CONTEXT.md).
    """

    DUPLICATE_TOLERANCE = 1e-4
    # Members of one node a search can return; a search for k asks for k nodes, so k never needs more.
    MAX_EXPANSION = 8

    def __init__(self, dim, m, ef_construction, ef_search):
        self.dim = dim
        self.m = m
        self.ef_construction = ef_construction
        self.ef_search = ef_search
        self.vectors = np.zeros((0, dim), dtype=np.float32)
        self.node_rows = np.zeros(0, dtype=np.int64)  # graph node -> its first vector
        self.members = np.zeros((0, self.MAX_EXPANSION), dtype=np.int32)  # node -> vectors, -1 padded
        self.member_counts = np.zeros(0, dtype=np.int64)
        self.radius = 0.0
        self.index = None
        self.orphans = np.zeros(0, dtype=np.int64)  # graph nodes without an incoming level-0 edge

    def __len__(self):
        return len(self.vectors)

    def _new_index(self):
        index = faiss.IndexHNSWFlat(self.dim + 1, self.m)
        index.hnsw.efConstruction = self.ef_construction
        index.hnsw.efSearch = self.ef_search
        return index

    def _augment(self, vectors):
        lift = np.sqrt(np.maximum(self.radius**2 - (vectors**2).sum(axis=1), 0.0)).astype(np.float32)
        return np.concatenate([vectors, lift[:, None]], axis=1)

    def _nodes_of(self, rows):
        """Graph node for each new vector (rows of self.vectors): an existing or earlier new node
        within the tolerance, else -1 (the vector becomes a node)."""
        vectors = self.vectors[rows]
        tolerance = (self.DUPLICATE_TOLERANCE * self.radius) ** 2
        nodes = np.full(len(rows), -1, dtype=np.int64)
        if self.index is not None and self.index.ntotal:
            distances, labels = self.index.search(self._augment(vectors), 1)
            close = distances[:, 0] <= tolerance
            nodes[close] = labels[close, 0]
        # Duplicates among the new vectors themselves: each joins the first such vector, or the
        # vector that one joined (closeness is not transitive: a ~ b and b ~ c without a ~ c).
        fresh = np.flatnonzero(nodes < 0)
        if len(fresh) > 1:
            points = vectors[fresh].astype(np.float64)  # float64: no cancellation at this tolerance
            squared = (points**2).sum(axis=1)
            close = squared[:, None] + squared[None, :] - 2 * points @ points.T <= tolerance
            np.fill_diagonal(close, True)
            root = np.argmax(close, axis=1)  # itself at the latest
            while not np.array_equal(root[root], root):
                root = root[root]
            nodes[fresh] = np.where(root < np.arange(len(fresh)), -2 - fresh[root], -1)
        return nodes

    def _find_orphans(self):
        """Graph nodes that no node's level-0 neighbour list holds, except the entry point."""
        hnsw = self.index.hnsw
        starts = faiss.vector_to_array(hnsw.offsets)[:-1].astype(np.int64)
        neighbors = faiss.vector_to_array(hnsw.neighbors)
        linked = neighbors[starts[:, None] + np.arange(hnsw.nb_neighbors(0))]
        in_degree = np.bincount(linked[linked >= 0], minlength=len(starts))
        orphans = np.flatnonzero(in_degree == 0)
        return orphans[orphans != hnsw.entry_point]

    def add(self, vectors):
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if len(vectors) == 0:
            return
        first_row = len(self.vectors)
        self.vectors = np.concatenate([self.vectors, vectors])
        longest = float(np.sqrt((vectors**2).sum(axis=1).max()))
        if self.index is None or longest > self.radius:
            self.radius = max(2.0 * self.radius, longest * 1.25, 1e-6)
            self.index = self._new_index()
            if len(self.node_rows):
                self.index.add(self._augment(self.vectors[self.node_rows]))
        rows = np.arange(first_row, len(self.vectors))
        nodes = self._nodes_of(rows)
        new_nodes = np.flatnonzero(nodes == -1)
        node_of_new = {int(i): len(self.node_rows) + j for j, i in enumerate(new_nodes)}
        self.index.add(self._augment(self.vectors[rows[new_nodes]]))
        self.node_rows = np.concatenate([self.node_rows, rows[new_nodes]])
        self.members = np.concatenate(
            [self.members, np.full((len(new_nodes), self.MAX_EXPANSION), -1, dtype=np.int32)]
        )
        self.member_counts = np.concatenate([self.member_counts, np.zeros(len(new_nodes), dtype=np.int64)])
        for i, node in enumerate(nodes.tolist()):
            if node == -1:
                node = node_of_new[i]
            elif node <= -2:  # joins a new vector of this call (index -2 - node within the call)
                node = node_of_new[-2 - node]
            count = self.member_counts[node]
            if count < self.MAX_EXPANSION:
                self.members[node, count] = rows[i]
            self.member_counts[node] = count + 1
        self.orphans = self._find_orphans()

    def search(self, queries, k):
        """queries (s, d) -> labels (s, k) int64: insertion positions of the vectors with the
        largest inner products (-1 where fewer than k vectors exist)."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        k = min(k, len(self.vectors))
        if k == 0:
            return np.full((len(queries), 0), -1, dtype=np.int64)
        augmented = np.concatenate([queries, np.zeros((len(queries), 1), dtype=np.float32)], axis=1)
        distances, nodes = self.index.search(augmented, min(k, len(self.node_rows)))
        if len(self.orphans):
            nodes = self._with_orphans(queries, distances, nodes, k)
        candidates = np.where(nodes[..., None] >= 0, self.members[np.maximum(nodes, 0)], -1).reshape(len(queries), -1)
        # Keep the first k real members of each row, in order.
        order = np.argsort(candidates < 0, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(candidates, order, axis=1).astype(np.int64)

    def _with_orphans(self, queries, distances, nodes, k):
        """The graph's nodes (s, k') and their distances, plus the orphans -> the best k nodes (s, k)."""
        # |q - x'|^2 = |q|^2 + R^2 - 2 q.x for a lifted x', so the graph's distances give its inner products.
        found_scores = ((queries**2).sum(axis=1, keepdims=True) + self.radius**2 - distances) / 2
        orphan_scores = queries @ self.vectors[self.node_rows[self.orphans]].T
        orphan_scores[(nodes[:, :, None] == self.orphans).any(axis=1)] = -np.inf  # the graph found it too
        nodes = np.concatenate([nodes, np.broadcast_to(self.orphans, orphan_scores.shape)], axis=1)
        scores = np.concatenate([found_scores, orphan_scores], axis=1)
        scores[nodes < 0] = -np.inf
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(nodes, order, axis=1)


class HnswRetriever:
    """One MipsHnsw per (sequence, kv head); block j is added once it is a candidate for some query.

    Labels are positions in the order of insertion; `block_ids` maps them back to block ids, so
    the answer stays right however blocks were inserted.
    """

    def __init__(self, m, ef_construction, ef_search):
        self.settings = (m, ef_construction, ef_search)
        self.graphs = None
        self.block_ids = None

    def add_candidates(self, summaries, limits):
        """Insert, per sequence, every block below its largest limit that is not in its graphs yet."""
        b, g, _, d = summaries.shape
        if self.graphs is None:
            self.graphs = [[MipsHnsw(d, *self.settings) for _ in range(g)] for _ in range(b)]
            self.block_ids = [np.zeros(0, dtype=np.int64) for _ in range(b)]
        if len(self.graphs) != b:
            raise ValueError(f"this HNSW state holds {len(self.graphs)} sequences, the call has {b}")
        wanted = limits.max(dim=1).values.tolist()
        for row in range(b):
            have = len(self.block_ids[row])
            if wanted[row] <= have:
                continue
            new_blocks = summaries[row, :, have : wanted[row]].detach().float().cpu().numpy()
            for head in range(g):
                self.graphs[row][head].add(new_blocks[head])
            self.block_ids[row] = np.concatenate([self.block_ids[row], np.arange(have, wanted[row])])

    def select(self, group_queries, summaries, limits, top_n):
        """Search each graph with k = top_n + (blocks past the query's own limit), then keep the
        first top_n labels that are candidates for that query: exact when the graph's recall is 1.
        """
        self.add_candidates(summaries, limits)
        b, g, s, _ = group_queries.shape
        block_ids = torch.zeros(b, g, s, top_n, dtype=torch.long)
        valid = torch.zeros(b, g, s, top_n, dtype=torch.bool)
        if top_n == 0:
            return block_ids.to(group_queries.device), valid.to(group_queries.device)
        queries = group_queries.detach().float().cpu().numpy()
        limits_np = limits.cpu().numpy()
        for row in range(b):
            stored = len(self.block_ids[row])
            if stored == 0:
                continue
            extra = int(stored - limits_np[row].min())
            for head in range(g):
                labels = self.graphs[row][head].search(queries[row, head], top_n + extra)
                found = np.where(labels >= 0, self.block_ids[row][np.maximum(labels, 0)], np.iinfo(np.int64).max)
                keep = found < limits_np[row][:, None]
                rank = np.cumsum(keep, axis=1)
                keep &= rank <= top_n
                query_index, slot = np.nonzero(keep)
                column = rank[query_index, slot] - 1
                block_ids[row, head, query_index, column] = torch.from_numpy(found[query_index, slot])
                valid[row, head, query_index, column] = True
        return block_ids.to(group_queries.device), valid.to(group_queries.device)
