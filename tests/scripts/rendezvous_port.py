"""Run under torchrun: every rank joins the default gloo group, checks it works with one
all_reduce, and prints one JSON line with its rank and the rendezvous port it was given."""

import json
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(
    json.dumps(
        {
            "rank": dist.get_rank(),
            "master_port": int(os.environ["MASTER_PORT"]),
            "sum": int(total.item()),
        }
    ),
    flush=True,
)
dist.destroy_process_group()
