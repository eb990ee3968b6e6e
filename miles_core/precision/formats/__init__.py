"""The built-in precision formats (`rollout.precision`), one module each (fp8: fp8 and
fp8_block)."""
