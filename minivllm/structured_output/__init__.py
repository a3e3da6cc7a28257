"""Chapter 10: structured outputs — a grammar turns into a mask over the vocabulary, every step."""
