"""The paged KV cache and its quantized formats (KVSpec, codecs)."""
