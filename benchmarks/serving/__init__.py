"""A serving engine under load over loopback HTTP (llama-server, vLLM, SGLang, LMCache), and its load generator."""
