"""Analysis layer: replay, measurements, fits, cost and throughput models, verdicts."""
