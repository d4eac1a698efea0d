"""Stage 3, the model pass: what it runs (``settings``), the sampled turns of a log (``traffic``), each measured with
every repair (``turn``, ``repairs``) on a store of computed K/V (``kv_store``), its progress with time left (``meter``),
and a changed field as a Notes scenario (``notes``)."""
