"""Finding and loading a model: local directories, GGUF files (converted once), the Hugging Face cache,
weights fingerprints, refusal of quantized formats the forward cannot run; tiny random models for tests."""
