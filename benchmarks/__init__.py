"""Benchmark scripts (``python -m benchmarks.<folder>.<script>``), in folders by what they run; each writes its JSON (and
figures) to its own folder's ``results/``, which the app's Benchmarks tab reads (``benchmarks/*/results/*.json``).

- ``studies``: KVScope's engine in this process on one model: fidelity, decisions and speed of splicing, editing,
  composing and auditing, against a full recompute.
- ``app``: the app itself (``python app.py``) through its API: latency, a soak with many visitors, a Space's cold start.
- ``serving``: a serving engine under load over loopback HTTP (llama.cpp's llama-server, vLLM, SGLang, LMCache), the
  load generator, and the GPU entry point (``vllm_serving.sh``, with its LMCache plugin).
- ``interop``: KVScope's numbers beside another engine's own on the same tokens (llama-server's prefix-cache and
  ``--cache-reuse``, started as the serving benchmark starts it).

A folder imports from ``benchmarks.common`` and from its own folder; ``interop`` also imports ``serving``'s server
wrapper, and nothing imports ``interop``, ``studies`` or ``app``.
"""
