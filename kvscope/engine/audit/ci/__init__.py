"""The audit's top layer: the CI gate (``--fail-on``) and the pull-request Markdown, read from the report."""
