"""Checks of a loaded model: the support matrix (every cache operation against the model's own forward)."""
