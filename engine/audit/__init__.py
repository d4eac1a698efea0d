"""Your prompt, your traffic: a request log or one prompt audited for mutable fields in cached prefixes, every
repair measured against a clean prefill (``audit``), from requests parsed and rendered as a server sees them
(``requests``), with the fields found by a token diff (``fields``) and the repairs built on the notebook (``repairs``)."""
