"""Benchmarks: AR, SD, SSD and HuggingFace assisted generation side by side.

prompts: prompt sets from YAML (plain and chat prompts);
hf_assisted: transformers' `generate(assistant_model=...)`, timed like our engines;
runner: runs every mode over prompt sets and temperatures, collects stats;
report: aggregation, ratio tables, the physical limit, JSON/CSV/PNG output.
"""
