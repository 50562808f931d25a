"""${run_start:…} names one run directory for all ranks of a torchrun, whichever second each rank starts in."""

import subprocess
import sys

PRINT = (
    "import time; from omegaconf import OmegaConf; from colocated_grpo.launch import config_groups; "
    "config_groups.register_run_start(); "
    "print(OmegaConf.create({'d': '${run_start:%H-%M-%S}'}).d, time.strftime('%H-%M-%S'))"
)
# A stand-in for the torchrun agent: starts two "ranks" 1.5 s apart (TORCHELASTIC_RUN_ID and LOCAL_RANK set, as
# torchrun sets them), then a process of its own with only a leftover LOCAL_RANK.
AGENT = f"""
import os, subprocess, sys, time
code = {PRINT!r}
for rank in (0, 1):
    env = {{**os.environ, "TORCHELASTIC_RUN_ID": "test", "LOCAL_RANK": str(rank)}}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    time.sleep(1.5)
env = {{k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}}
subprocess.run([sys.executable, "-c", code], env={{**env, "LOCAL_RANK": "0"}}, check=True)
"""


def test_ranks_of_one_launch_resolve_the_same_start_and_a_plain_process_its_own():
    out = subprocess.run([sys.executable, "-c", AGENT], capture_output=True, text=True, check=True).stdout.split("\n")
    (rank0, now0), (rank1, now1), (alone, _) = (line.split() for line in out[:3])
    assert now0 != now1, "the two ranks ran in different seconds"
    assert rank0 == rank1, "yet they name the same run directory"
    assert alone != rank0, "a process started on its own names its own, a leftover LOCAL_RANK or not"
