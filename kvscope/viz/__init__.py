"""Plotly figure builders from the engine's result objects (no model calls)."""
