"""The model pass on a served model: an OpenAI-compatible client and what its answers say (``client``), and the
sampled turns and rewrites measured through it (``model_pass``)."""
