"""Training: the trainer-backend protocol, the FSDP2 backend, losses, advantages, LR schedule, SFT data."""
