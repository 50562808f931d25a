"""Start-up, the run loop and what a run is made of: config schema and checks, model, data, rewards, W&B."""
