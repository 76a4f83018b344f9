"""Shared test set-up: one torch thread and one FAISS (OpenMP) thread for the whole session.

CI has 2 cores; tests that spawn training subprocesses, DDP workers or FAISS searches run beside
the pytest process, and OpenMP thread pools that oversubscribe the cores slow everything down
several times over. One thread keeps timings stable and results deterministic.
"""

import faiss
import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    faiss_threads = faiss.omp_get_max_threads()
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(faiss_threads)


@pytest.fixture(autouse=True)
def prune_at_test_sizes(monkeypatch):
    """The "pruned" retrieval is exact_select below PrunedRetriever.min_blocks candidate blocks (1024),
    more than any model-level test holds: at 0 every test that uses it runs the branch and bound."""
    from model.retrieval import PrunedRetriever

    monkeypatch.setattr(PrunedRetriever, "min_blocks", 0)
