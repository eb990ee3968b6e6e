"""The Ray cluster backend's parts: joining the cluster, the placement group, the trainer ranks
and engine servers as actors."""
