"""`miles model init`: a random-init model of a preset on any tokenizer's vocabulary, with a TITO
family's chat template written into its directory, so that `miles tito verify --family F --model
OUT`, the session server's start-up check and training accept it.

The tokenizer comes from `--tokenizer`: a folder holding a Hugging Face tokenizer
(`tokenizer.json` or `tokenizer_config.json`), or an installed Python package that ships one (the
first folder in it, nearest the package's top, that holds `tokenizer.json`); without it, the
family's own (`family.tokenizer`, a Hugging Face tokenizer). The chat template is the family's
(`TitoFamily.chat_template`). The model is the preset's architecture (`models/presets.py`) with
the tokenizer's vocabulary, seeded. Before anything is written, the family's render of a probe
conversation must equal the tokenizer's with that template (`tito/check.py`); after, the folder
is loaded back and checked again.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_folder(spec: str) -> Path:
    """The folder of the tokenizer `spec` names: a folder, or an installed package's folder
    that holds `tokenizer.json`; ValueError saying what was looked for otherwise."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(
                f"--tokenizer {spec}: the folder holds no Hugging Face tokenizer "
                f"({' or '.join(TOKENIZER_FILES)})"
            )
        return path
    module = spec.replace("-", "_")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    roots = list(found.submodule_search_locations or []) if found is not None else []
    if not roots:
        raise ValueError(
            f"--tokenizer {spec}: neither a folder nor an installed package (pip install it, "
            "or give the folder of a Hugging Face tokenizer)"
        )
    hits = sorted(
        (p.parent for root in roots for p in Path(root).rglob("tokenizer.json")),
        key=lambda p: (len(p.parts), str(p)),
    )
    if not hits:
        raise ValueError(
            f"--tokenizer {spec}: the package ({', '.join(roots)}) ships no tokenizer.json; "
            "convert its tokenizer to a Hugging Face tokenizer folder and give that"
        )
    return hits[0]


def load_tokenizer(spec: str | None, family: Any):
    """The tokenizer a new model gets: `spec` (`tokenizer_folder`), else the family's own."""
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    if spec is not None:
        return AutoTokenizer.from_pretrained(str(tokenizer_folder(spec)))
    own = getattr(family, "tokenizer", None)
    if not isinstance(own, PreTrainedTokenizerBase):
        raise ValueError(
            f"TITO family {family.name!r} has no Hugging Face tokenizer of its own "
            "(`family.tokenizer`): give one with --tokenizer DIR|PACKAGE"
        )
    return own


def init_model(
    family_name: str,
    tokenizer_spec: str | None,
    preset: str,
    out: str | Path,
    seed: int = 0,
    context: int | None = None,
) -> dict[str, Any]:
    """Writes the model folder `out` (which must not exist, or be empty); returns a summary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_core.models.builder import count_parameters, preset_config, save_hf_dir
    from miles_core.models.family import MODEL_FAMILIES
    from miles_core.models.presets import PRESETS
    from miles_core.tito import build_family
    from miles_core.tito.check import check_family_matches

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder: choose a new one")
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r}: choose one of {', '.join(sorted(PRESETS))}")
    family = build_family(family_name)
    template = family.chat_template()
    if not template:
        raise ValueError(
            f"TITO family {family_name!r} has no Jinja chat template to write "
            "(`TitoFamily.chat_template`): a model folder must ship one"
        )
    tok = load_tokenizer(tokenizer_spec, family)
    tok.chat_template = template
    source = f"the tokenizer {tokenizer_spec or 'of the family'}"
    check_family_matches(family, tok, "--family", source, family_name)
    stop = family.stop_ids[0]
    eos = tok.eos_token_id if tok.eos_token_id is not None else stop
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    config = preset_config(preset, len(tok), pad, eos, context)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        MODEL_FAMILIES.get(PRESETS[preset].family).init_extra(model, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # staged beside: a rename
        staged = save_hf_dir(model, tok, Path(tmp) / "model")
        check_family_matches(
            family, AutoTokenizer.from_pretrained(staged), "--family", str(out), family_name
        )
        if out.exists():
            out.rmdir()
        staged.rename(out)
    return {
        "model": str(out),
        "family": family_name,
        "preset": preset,
        "vocab_size": len(tok),
        "parameters": count_parameters(model),
        "seed": seed,
    }
