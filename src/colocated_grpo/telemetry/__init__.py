"""What a run reports about itself: per-step metrics to the run files (and, through TRL, to W&B)."""
