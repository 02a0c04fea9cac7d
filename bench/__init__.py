"""Benchmarks, installed as ``specdec_kernels._bench``: ``python -m specdec_kernels bench``.

Each ``bench_<op>.py`` also runs on its own from a checkout
(``python bench/bench_chain_verify.py``); the scripts import one another by
their plain names (``import harness``), with this folder on ``sys.path``.
"""
