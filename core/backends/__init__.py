"""Backends: the model's forward and its KV cache behind one interface (transformers' model, or
the lean forward on packed and native kernels), and the conversation's cache kept between replies."""
