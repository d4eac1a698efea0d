"""Gradio wiring for KVScope (no computation lives here: handlers call kvscope/engine/ and kvscope/viz/)."""
