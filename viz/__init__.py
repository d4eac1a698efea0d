"""Plotly figure builders from engine result objects (no model calls)."""
