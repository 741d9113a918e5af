"""Tooling: benchmarks (bench) and research ablations (ablation). The runtime never imports it."""
