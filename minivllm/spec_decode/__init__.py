"""Chapter 08: speculative decoding — guess several tokens cheaply, verify them in one forward."""
