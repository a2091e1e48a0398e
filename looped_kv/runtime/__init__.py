"""Model runtime: configuration, the looped model, attention routing, loading, cache policies, plane caches, memory."""
