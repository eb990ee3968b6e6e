"""Diffusion RL: a text-conditioned flow-matching image model trained with an image loss.

    scenes.py       the compositional prompts (count, colour, shape, position), the held-out split
    render.py       training images drawn to match a scene
    checker.py      the GenEval-style checker: an image against its scene, per attribute
    model.py        the image model (diffusers' UNet or MMDiT over pixels, word embeddings, the
                    flow-matching scheduler), saved and loaded as a diffusers-style directory
    sde.py          Flow-GRPO's SDE step and its per-step log-prob, shared by engine and trainer
    pretrain.py     flow-matching pretraining (the SFT stage) and the checker's evaluation
    wire.py         the rollout request and response (sglang-diffusion's fields)
    engine.py       the image engine in process; server.py behind HTTP; client.py its client
    loss.py         what an image loss (train/losses/flow_grpo.py, diffusion_nft.py) is called with
    trainer.py      the image trainer (FSDP2)
    rollout.py      a step's rollout: prompts, images, rewards, advantages
    producer.py     rollouts ahead of the trainer (one_step_off, fully_async)
    evaluation.py   held-out accuracy and the image grid per evaluation
    runtime.py      ImageRuntime: the text runtime's phases for an image run
    preflight.py    an image run's inputs, checked before anything starts

A run is an image run when its config has a `diffusion:` section (config/diffusion.py);
docs/diffusion.md is the user's guide.
"""
