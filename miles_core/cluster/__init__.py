"""Where a run's processes run (`cluster.backend`): on this machine (`local`: torchrun ranks and
subprocesses) or placed by Ray on a cluster's GPUs (`ray`)."""
