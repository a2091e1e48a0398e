"""Decoding: one batch-first core, a module per decoder, and generate() on top."""
