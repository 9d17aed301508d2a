"""Typed messages for every process and network edge (torch-free)."""
