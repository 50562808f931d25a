"""Processes: the entry point, server placement, sweep planning and the local and SLURM sweep launchers."""
