"""Prompts as text, no torch: the request each prompt-level repair sends (``repair_requests``), the template format
(``template``) and the text spans a user names or is offered (``text_spans``)."""
