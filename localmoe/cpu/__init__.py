"""CPU kernels: the packed GGUF matmul (C, built on first use) and thread-count policy."""
