"""Deployment: set-up script, run configs and (later) topology files, SLURM and ssh recipes."""
