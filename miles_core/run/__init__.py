"""One RL run without Prefect: its components composed (`runtime`), the long-running loops a flow
runs them in (`loops`), the trainer of the run (`training`), per-step bookkeeping (`steplog`),
MLflow tracking (`tracking`), the checks before anything starts (`preflight`), progress
reporting (`progress`) and the phase marks an outside harness times (`timeline`)."""
