"""Models: the catalog and its downloads, weight loading (HF directories, safetensors, GGUF) and
tokenizers."""
