"""Benchmarks and the ablation study: scripts that measure speed, memory, recall or loss and print tables.

Each runs from the repository root as a file or as a module (`python benchmarks/bench_attention.py`,
`python -m benchmarks.bench_attention`); common.py holds what the bench_* scripts share.
"""
