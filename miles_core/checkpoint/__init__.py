"""A run's checkpoints and what makes a resume exact: the store under an fsspec root (`store`),
what a step's checkpoint holds and how a run continues from it (`checkpointing`), the samples
each step trained (`ledger`), random-number states (`rng_state`), what a resume may change
(`resume_checks`), the tracking a killed process missed (`catch_up`), and the lock that gives a
run name to one live run (`run_lock`)."""
