"""Surviving failures: checkpoints and resume, attempts in run.json, preemption, non-finite values, start-up
memory errors explained, W&B rewound, credentials kept out of files."""
