"""True on-policy (`train.true_on_policy`): the engines and the trainer run one forward whose
numbers do not depend on the batch, so the log-probs a rollout records are the bits the trainer
computes (`train/train_rollout_logprob_abs_diff` exactly 0). `ops.py`: the invariant kernels;
`forward.py`: what a model family's invariant forward provides, and the embedded engine's
`BatchForward` on it; `contract.py`: what a run must meet, checked before it starts."""
