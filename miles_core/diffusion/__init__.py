"""Diffusion models: text-conditioned flow-matching image generation and its RL."""
