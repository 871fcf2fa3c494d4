"""Model execution: forward on reused KV, sparse recompute, greedy decoding."""
