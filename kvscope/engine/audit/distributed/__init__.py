"""The audit on Ray: the token pass on many processes or machines (``ray_scan``) and the sampled turns measured by
actors that hold the model (``turns``)."""
