"""KVScope's numbers beside llama.cpp's llama-server's own, on the same tokens."""
