"""One module per role: conductor, prefill, decode, store; plus dev mode."""
