"""Built-in advantage transforms, one module each (`../advantage_transform.py`)."""
