"""The model's own forward: the decoder over a paged KV cache, attention, rotary embeddings, weight-only
int8 and int4 projections, and the model families as small specs over one forward."""
