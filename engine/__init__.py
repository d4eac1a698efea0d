"""KVScope engine: a model's KV cache as an editable, composable notebook (torch + transformers only)."""
from engine.models.cpu_math import tune_cpu_math

tune_cpu_math()
