"""The audit's measured repairs as a policy a gateway applies (docs/deploy.md): ``document`` declares the policy (its
JSON, its schema, its checks at load), ``build`` makes it from an audit's measured turns (or forces one repair on the
token pass's fields), ``rewrite`` applies it to one request (``rewrite_request``, pure), and ``gateway`` to a proxy's
request body without ever failing it. Text only, no torch: a gateway loads it without the model stack."""
