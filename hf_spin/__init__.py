"""hf_spin: lossless speculative decoding with a pool of heterogeneous assistants for `transformers`."""
