"""Training: the trainer-backend protocol (backend.py) and the backends (backends/: FSDP2,
Megatron-core), the shared step loop (step.py), losses (loss.py, losses/), advantage estimators
(advantage.py, advantages/), off-policy corrections, the LR schedule and SFT."""
