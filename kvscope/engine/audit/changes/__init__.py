"""What changed between two requests and why a request misses: the token diff that finds fields (``fields``) and the
named causes of a miss (``causes``)."""
