"""On-policy distillation: teachers served as engines score the student's sampled token ids
(`teachers.py`), each sample gets the teacher's per-token log-probs as a declared token field
(`field.py`), and the `opd` advantage transform turns the difference into the advantage
(`miles_core/train/advantage_transforms/opd.py`). The settings: `config/distill.py`."""
