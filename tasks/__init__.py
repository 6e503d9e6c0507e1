"""Datasets and reward functions: reasoning-gym tasks, JSONL prompt files, built-in rewards."""
