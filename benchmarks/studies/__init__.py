"""KVScope's engine in this process on one model: fidelity, decisions and speed, against a full recompute."""
