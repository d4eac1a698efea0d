"""Stage 1, reading: request logs in any format gateways and observability tools record (``formats``, ``sources``), one
file or many shards (``shards``), each record read as the request a server received (``requests``), with the usage
it reported (``usage``) and the reply it generated (``replies``)."""
