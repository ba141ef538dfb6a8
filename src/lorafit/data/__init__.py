"""Datasets: loaders, format detection and conversion, checks, and the token profile the planner uses."""
