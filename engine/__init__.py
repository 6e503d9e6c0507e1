"""Engine: the model, KV cache, sampling, speculative decoding and drafters — pure tensor code, no sockets."""
