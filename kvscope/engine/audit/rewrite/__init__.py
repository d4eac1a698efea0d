"""A rewrite of a log measured against the original: reuse before and after, and fidelity request by request
(``measure``)."""
