"""Run under torchrun: every rank joins the default gloo group, checks it works with one
all_reduce, and prints one JSON line with its rank and the rendezvous port it was given."""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
line = {
    "rank": dist.get_rank(),
    "master_port": int(os.environ["MASTER_PORT"]),
    "sum": int(total.item()),
}
# one write() of the whole line: print() writes the text and the newline separately, so two
# ranks sharing a pipe could interleave as '{...}{...}\n\n'
sys.stdout.write(json.dumps(line) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
