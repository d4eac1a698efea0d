"""KVScope engine: a model's KV cache as an editable, composable notebook (torch + transformers only)."""
