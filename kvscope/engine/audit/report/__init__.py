"""The report read by CI: ``--fail-on`` conditions and the Markdown summary for a pull request (``gate``)."""
