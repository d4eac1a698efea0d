"""The audit's records, the lowest layer: the report's types (``types``) and the JSON Schema derived from them (``schema``)."""
