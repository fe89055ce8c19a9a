"""Model files: GGUF and HF safetensors readers, block dequantization, the model store."""
