"""`miles plan`: a dry run of a run config on a GPU fleet (layout, memory, placement)."""
