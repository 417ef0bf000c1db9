"""Dense (non-expert) layers at decode: kernels.dense.decode_linear."""
