"""The built-in cluster backends: `local` and `ray`."""
