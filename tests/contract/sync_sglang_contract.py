"""Regenerates `sglang_api.json`: the field names of SGLang's request structs and its HTTP routes,
read (with `ast`, nothing imported or copied) from an sglang wheel.

    pip download --no-deps sglang==<version> -d /tmp/sgl
    python tests/contract/sync_sglang_contract.py /tmp/sgl/sglang-<version>-*.whl

`test_sglang_contract.py` checks our engine client and server against the JSON; re-run this when
the SGLang version on the GPU hosts moves, and commit the new JSON with the test result.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

STRUCTS = (
    "GenerateReqInput",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "AbortReq",
    "UpdateWeightVersionReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightsFromTensorReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "InitWeightsUpdateGroupReqInput",
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
    "CheckWeightsReqInput",
    "LoadLoRAAdapterReqInput",
    "UnloadLoRAAdapterReqInput",
    "LoadLoRAAdapterFromTensorsReqInput",
    "BaseReq",
)


def _fields(cls: ast.ClassDef) -> list[str]:
    return [
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]


def extract(wheel: Path) -> dict:
    z = zipfile.ZipFile(wheel)
    version = re.search(r"sglang-([^-]+)-", wheel.name).group(1)
    io = ast.parse(z.read("sglang/srt/managers/io_struct.py").decode())
    classes = {n.name: n for n in io.body if isinstance(n, ast.ClassDef)}
    structs = {}
    for name in STRUCTS:
        if name not in classes:
            continue
        fields = _fields(classes[name])
        bases = [ast.unparse(b) for b in classes[name].bases]
        if "BaseReq" in bases:
            fields = _fields(classes["BaseReq"]) + fields
        structs[name] = sorted(set(fields))
    sp = ast.parse(z.read("sglang/srt/sampling/sampling_params.py").decode())
    cls = next(n for n in sp.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    init = next(
        (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
    )
    if init is not None:  # older releases: a plain class with keyword arguments
        sampling = sorted(a.arg for a in init.args.args + init.args.kwonlyargs if a.arg != "self")
    else:  # newer releases: a msgspec.Struct with annotated fields
        sampling = sorted(_fields(cls))
    server_args: set[str] = set()  # `launch_server` flags are `--` + field name with dashes
    for name in z.namelist():
        if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
            for node in ast.walk(ast.parse(z.read(name).decode())):
                if isinstance(node, ast.ClassDef):
                    server_args.update(_fields(node))
    server = z.read("sglang/srt/entrypoints/http_server.py").decode()
    routes = sorted(set(re.findall(r"@app\.(?:get|post|put|api_route)\(\s*\"(/[^\"]*)\"", server)))
    return {
        "sglang_version": version,
        "structs": structs,
        "sampling_params": sampling,
        "routes": routes,
        "server_args": sorted(server_args),
    }


if __name__ == "__main__":
    data = extract(Path(sys.argv[1]))
    out = Path(__file__).with_name("sglang_api.json")
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out} for sglang {data['sglang_version']}: {len(data['routes'])} routes")
