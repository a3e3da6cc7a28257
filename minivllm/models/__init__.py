"""Chapter 00's model: the Llama-family transformer, its loader, its linear layers, tiny test models."""
