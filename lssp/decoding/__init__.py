"""Decoding: sampling, the RSp and SSp loops, verification, KV caches, clocks."""
