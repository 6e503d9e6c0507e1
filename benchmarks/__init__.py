"""Benchmarks behind `slipstream bench …`: each prints one JSON object, ratios measured side by side."""
