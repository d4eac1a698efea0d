"""The cache layer: a context's K/V as an immutable :class:`~kvscope.engine.cache.notebook.Notebook` and every operation on it.

Bottom of the engine's layers (above only ``scenario``, ``errors``, ``progress`` and ``once``): nothing here imports
the edit, probe or composition layers. ``adapter`` is the only module that touches transformers' cache internals and
forward keywords; ``rope`` is the one re-rotation; ``decision`` the one readout; ``selftest`` the numeric check the
splice gate (``loaded.SpliceGate``) relies on.
"""
