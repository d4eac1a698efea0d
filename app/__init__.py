"""Gradio wiring for KVScope (no computation lives here: handlers call engine/ and viz/)."""
