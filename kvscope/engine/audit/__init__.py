"""Your prompt, your traffic: a request log (or one prompt) audited for mutable fields in cached prefixes, in stages,
each a subpackage (docs/architecture.md maps them; an import-linter contract keeps each stage above the ones it reads):

- ``paged_blocks``: the block arithmetic of a paged KV cache (block size, whole-block prefix, chained block hashes);
- ``logs``: read a log, in any recorded format, as the requests a server received, with usage and replies;
- ``changes``: what changed between two requests (the fields) and why a request misses;
- ``simulate``: the prefix caches of serving engines, hosted providers and fleets, fed request by request;
- ``scan``: the token pass over the whole log through the simulated caches, and the sample for the model;
- ``prompts``: the request each prompt-level repair sends, templates and text spans (text only, no torch);
- ``measure``: the model pass, each sampled turn measured with every repair against a clean prefill;
- ``rewrite``: a rewritten log measured against the original;
- ``policy``: the measured repairs as a policy, applied to a request (``rewrite_request``) offline or at a gateway;
- ``endpoint``: the model pass on a served model instead of in torch;
- ``report``: the records every stage declares its results with (the lowest layer);
- ``ci``: the whole report, its JSON Schema, the CI gate and Markdown over it (the top layer);
- ``distributed``: the token pass and the model pass on Ray.
"""
