"""Building blocks of the model: norms, rotary embeddings, attention, FFNs, the block."""
