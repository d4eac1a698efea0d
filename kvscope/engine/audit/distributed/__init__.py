"""The audit on Ray: the token pass on many processes or machines (``token_pass``) and the sampled turns measured by
actors that hold the model (``turns``)."""
