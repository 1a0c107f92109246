"""Workloads: prompt lists, task categories, arithmetic problems."""
