"""Headless CLI: ``python -m kvscope
info|selftest|support|decide|edit|calibrate|probe|weights|compose|image|agent|keystone|memory|compare-models|audit|audit-schema``
(``kvscope …`` and ``python -m kvscope.engine.cli …`` are the same).

With ``--json`` exactly one JSON object goes to stdout (an ``{"error": ...}`` object and exit code 2 on
bad input); logs and progress go to stderr. The package by job: ``common`` (logging, loading, shared flags),
``checks`` (info, selftest, support), ``edit`` (decide, edit, calibrate, probe, weights), ``compose`` (compose,
image, agent, keystone, memory), ``compare`` (compare-models), ``audit`` (audit, audit-schema) and ``parser`` (the parser, the
entry point).
"""

from kvscope.engine.cli.parser import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
