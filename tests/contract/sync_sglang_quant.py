"""Regenerates `sglang_quant.json`: what SGLang's quantization methods read from a checkpoint,
extracted (with `ast`, nothing imported or copied) from an sglang wheel:

    pip download --no-deps sglang==<version> -d /tmp/sgl
    python tests/contract/sync_sglang_quant.py /tmp/sgl/sglang-<version>-*.whl

- `methods`: every `quant_method` name SGLang registers (BASE_/CPU_QUANTIZATION_METHODS);
- per method we write: the keys its config class's `from_config` requires (`get_from_keys`)
  and may read (`get_from_keys_or`, `config.get`, `config[...]`), the parameter names its
  linear method registers (`register_parameter` anywhere in the class), and the methods `get_quant_method` returns;
- `modelopt_algos`: the strings `ModelConfig._parse_modelopt_quant_config` tests `quant_algo`
  against (how `quant_method: modelopt` becomes modelopt_fp4).

`test_sglang_quant_contract.py` checks `miles convert`'s output against the JSON.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

Q = "sglang/srt/layers/quantization/"
# method → (file, config class, file of its linear method, linear method class | None)
TARGETS = {
    "fp8": ("fp8.py", "Fp8Config", "fp8.py", "Fp8LinearMethod"),
    "modelopt_fp4": (
        "modelopt_quant.py",
        "ModelOptFp4Config",
        "modelopt_quant.py",
        "ModelOptFp4LinearMethod",
    ),
    "compressed-tensors": (
        "compressed_tensors/compressed_tensors.py",
        "CompressedTensorsConfig",
        "compressed_tensors/schemes/compressed_tensors_wNa16.py",
        "CompressedTensorsWNA16",
    ),
    "mxfp4": ("mxfp4.py", "Mxfp4Config", "mxfp4.py", None),
}


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _strings(node: ast.AST) -> list[str]:
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def _config_keys(fn: ast.FunctionDef) -> tuple[set[str], set[str]]:
    required, optional = set(), set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            attr = n.func.attr
            if attr in ("get_from_keys", "get_from_keys_or") and len(n.args) > 1:
                (required if attr == "get_from_keys" else optional).update(_strings(n.args[1]))
            elif attr == "get" and isinstance(n.func.value, ast.Name) and n.args:
                if n.func.value.id == "config" and isinstance(n.args[0], ast.Constant):
                    optional.add(n.args[0].value)
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
            if n.value.id == "config" and isinstance(n.slice, ast.Constant):
                optional.add(n.slice.value)
    return required, optional - required


def _registered(fn: ast.AST) -> list[str]:
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "register_parameter":
            if n.args and isinstance(n.args[0], ast.Constant):
                out.add(n.args[0].value)
    return sorted(out)


def _returned(fn: ast.FunctionDef) -> list[str]:
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Call):
            f = n.value.func
            out.add(f.id if isinstance(f, ast.Name) else ast.unparse(f))
    return sorted(out)


def _methods(tree: ast.Module) -> list[str]:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Dict) and all(isinstance(k, ast.Constant) for k in n.keys):
            names.update(k.value for k in n.keys if isinstance(k.value, str))
    return sorted(names)


def extract(wheel: Path) -> dict:
    z = zipfile.ZipFile(wheel)
    read = lambda path: ast.parse(z.read(path).decode())  # noqa: E731
    out = {
        "sglang_version": re.search(r"sglang-([^-]+)-", wheel.name).group(1),
        "methods": _methods(read(Q + "__init__.py")),
        "configs": {},
    }
    for method, (file, config_cls, linear_file, linear_cls) in TARGETS.items():
        cls = _class(read(Q + file), config_cls)
        required, optional = _config_keys(_method(cls, "from_config"))
        entry = {
            "class": config_cls,
            "required_keys": sorted(required),
            "optional_keys": sorted(optional),
            "get_quant_method_returns": _returned(_method(cls, "get_quant_method")),
            "linear_parameters": [],
        }
        if linear_cls:
            lin = _class(read(Q + linear_file), linear_cls)
            entry["linear_parameters"] = _registered(lin)
        out["configs"][method] = entry
    mc = _class(read("sglang/srt/configs/model_config.py"), "ModelConfig")
    words = _strings(_method(mc, "_parse_modelopt_quant_config"))
    out["modelopt_algos"] = sorted({w for w in words if w and not any(c.isspace() for c in w)})
    return out


if __name__ == "__main__":
    data = extract(Path(sys.argv[1]))
    target = Path(__file__).with_name("sglang_quant.json")
    target.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {target} (sglang {data['sglang_version']})")
