"""Every backticked name in ARCHITECTURE.md and docs/*.md exists: in the code, in the config tree,
or on disk (docs/log.md, a dated history, is left out: it names what existed then).

What is read: the inline code spans of each page (CommonMark's rule: a run of n backticks closes
at the next run of exactly n, within one paragraph or one table row). Fenced code blocks are left
out whole: they hold YAML, shell sessions and ASCII pictures, whose words are not references,
and their own checks are elsewhere (the examples' YAML is loaded by the tests that run it).

What a span is, and what it is checked against (the first form that fits):

- a source path (`weights/transport.py`, `tests/plugins/`, `cli.py`): a file or folder of the
  repository whose path ends so (relative to the root, to `miles_core/`, `tests/`, ...); a path
  with `: name` after it also needs `name` defined in that file. Paths outside the source
  folders (`./mlflow.db`, `optimizer/`) are run-time files and are not checked.
- an import path `pkg.mod:obj` of a module in the repo: the object is defined in that module.
- a config key (`train.lr`, `rollout.engine_options.num_engines`, `model.path: DIR`,
  `--set train.world_size=2`): its path in the `RunConfig` tree, read from the pydantic models'
  source with `ast` (importing `miles_core.config` imports torch: seconds). A plug-in's
  `*_options` keys are the fields of the `PluginOptions` classes in the folder of the registry
  whose setting names the plug-in (`rollout.engine` → `miles_core/engines/kinds/`).
- a code name (`RunConfig`, `TRANSPORTS.register`, `miles_core.train.backend`,
  `RolloutProducer.take`, `check(name)`, `@REGISTRY.register(...)`): collected with `ast` from
  the Python files of miles_core/, flows/, tasks/, benchmarks/, infra/, tests/, deployments/,
  examples/ and docs/hooks.py: modules, module-level functions, classes and assignments, class members (methods,
  class attributes, `self.x` assignments), function parameters, and what the code takes from
  outside libraries (imported names, `torch.equal`-style attribute chains, keyword arguments).
  `Class.member` needs the member on that class (or a class it extends in the repo); other
  dotted names need every part to be a name of the code and the last one defined there. A name
  may also be a string the code uses (`"colocated"`, `MILES_API_KEY`, a metric tag), or a word
  of the build files (Makefile, pyproject.toml).
- not checked: HTTP routes (`/generate`), metric names (`train/grad_norm`), shell commands other
  than the repo paths and modules they name, templates (`<name>`, `{N}`), numbers and literals,
  URLs, and prose fragments.

`ALLOWED` lists the outside names the docs mention that the code neither defines nor uses
verbatim, by group; keep it short.
"""

from __future__ import annotations

import ast
import builtins
import functools
import keyword
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CODE_DIRS = (
    "miles_core",
    "flows",
    "tasks",
    "benchmarks",
    "infra",
    "tests",
    "deployments",
    "examples",
)
BUILD_FILES = ("Makefile", "pyproject.toml", ".ci/run")  # and every YAML file of CODE_DIRS
SKIP_DIRS = {".git", "__pycache__", "site", "node_modules", ".prefect", ".local-stack", ".gpu"}

# Outside names the docs mention that the code neither defines nor uses verbatim (what the code
# imports, calls or spells out, `torch.equal` or `"chromium"`, passes without a line here).
ALLOWED = {
    # the shell, Kubernetes, the S3 API
    "ps",
    "NetworkPolicy",
    "PutObject",
    # the standard library, named where megatron-core uses it
    "multiprocessing.Manager",
    # counters the session server names at run time (f"replies_{how}")
    "replies_text",
    "replies_inexact",
    # torch and Hugging Face transformers: the modules the models are built from
    "padding_idx",
    "Qwen3MoeForCausalLM",
    "Glm4MoeForCausalLM",
}

# the first word of a shell command (with arguments after it)
COMMANDS = {
    "miles",
    "make",
    "python",
    "pip",
    "prefect",
    "pytest",
    "torchrun",
    "curl",
    "kill",
    "ls",
    "cat",
    "echo",
    "grep",
    "apt-get",
    "nvidia-smi",
    "mkdocs",
    "local-stack",
    "infra/local-stack",
    ".venv/bin/pip",
}
# stand-ins the docs write for any name: `REGISTRY.register(name)`, `pkg.mod:Class`, `_x`
PLACEHOLDERS = {"REGISTRY", "pkg", "package", "mypkg", "mod", "module", "_x", "x", "Class"}
METRIC_PREFIXES = {"rollout", "train", "perf", "eval", "sft", "buffer", "agent", "engine"}
SOURCE_EXTENSIONS = (".py", ".md", ".yaml", ".yml", ".toml")
LITERALS = {"true", "false", "null", "none", "True", "False", "None"}
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"{IDENT}(?:\.{IDENT})*")


# ----------------------------------------------------------------------------- the code's names
@dataclass
class CodeIndex:
    """What the code defines and uses; `check_*` below read it."""

    defined: set[str] = field(default_factory=set)  # modules, top-level names, members, params
    known: set[str] = field(default_factory=set)  # also locals, import aliases, attributes used
    used: set[str] = field(default_factory=set)  # imported names, attribute names, kwargs
    chains: set[str] = field(default_factory=set)  # `torch.equal`, import paths, their prefixes
    strings: set[str] = field(default_factory=set)  # string constants (and build-file words)
    modules: dict[str, set[str]] = field(default_factory=dict)  # dotted module -> its names
    short: dict[str, set[str]] = field(default_factory=dict)  # file stem -> dotted modules
    files: dict[str, set[str]] = field(default_factory=dict)  # repo path -> names defined in it
    classes: dict[str, set[str]] = field(default_factory=dict)  # class -> members
    bases: dict[str, set[str]] = field(default_factory=dict)  # class -> base class names
    paths: set[str] = field(default_factory=set)  # every file and folder, repo-relative
    folders: set[str] = field(default_factory=set)  # folder names: miles_core, transports, ...
    config_keys: set[str] = field(default_factory=set)  # every dotted key of RunConfig
    config_free: set[str] = field(default_factory=set)  # keys whose sub-keys are free (dicts)
    config_fields: set[str] = field(default_factory=set)  # every field name of the tree

    def without(self, name: str) -> CodeIndex:
        """A copy as if the code no longer had `name` anywhere (a renamed function)."""

        def drop(s: set[str]) -> set[str]:
            return {x for x in s if x != name and not x.endswith(f".{name}")}

        return CodeIndex(
            defined=drop(self.defined),
            known=drop(self.known),
            used=drop(self.used),
            chains=drop(self.chains),
            strings=drop(self.strings),
            modules={k: drop(v) for k, v in self.modules.items()},
            short=self.short,
            files={k: drop(v) for k, v in self.files.items()},
            classes={k: drop(v) for k, v in self.classes.items() if k != name},
            bases=self.bases,
            paths=self.paths,
            folders=self.folders,
            config_keys=self.config_keys,
            config_free=self.config_free,
            config_fields=self.config_fields,
        )


def _chain(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for e in node.elts for n in _targets(e)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return []


def _index_module(tree: ast.Module, dotted: str, rel: str, index: CodeIndex) -> None:
    top: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, ast.Assign):
            top.update(n for t in node.targets for n in _targets(t))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            top.update(_targets(node.target))
        elif isinstance(node, ast.ImportFrom):
            top.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            top.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # guarded definitions
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    top.add(sub.name)
                elif isinstance(sub, ast.ImportFrom):
                    top.update(a.asname or a.name for a in sub.names)
    index.modules.setdefault(dotted, set()).update(top)
    index.files.setdefault(rel, set()).update(top)
    index.defined.update(top)
    repo_roots = {*CODE_DIRS, "docs"}

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            members = index.classes.setdefault(node.name, set())
            index.bases.setdefault(node.name, set()).update(
                (_chain(b) or "").rpartition(".")[2] for b in node.bases
            )
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.Assign):
                    members.update(n for t in item.targets for n in _targets(t))
                elif isinstance(item, ast.AnnAssign):
                    members.update(_targets(item.target))
            for sub in ast.walk(node):  # self.x = ... in its methods
                if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                    for t in targets:
                        for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                            if (
                                isinstance(e, ast.Attribute)
                                and isinstance(e.value, ast.Name)
                                and e.value.id in ("self", "cls")
                            ):
                                members.add(e.attr)
            index.defined.update(members)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    index.defined.add(arg.arg)
            if not isinstance(node, ast.Lambda):
                index.defined.add(node.name)
        elif isinstance(node, ast.Name):
            index.known.add(node.id)
        elif isinstance(node, ast.Attribute):
            index.used.add(node.attr)
            chain = _chain(node)
            if chain:
                index.chains.add(chain)
        elif isinstance(node, ast.keyword) and node.arg:
            index.used.add(node.arg)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            index.chains.add(node.module)
            index.chains.update(f"{node.module}.{a.name}" for a in node.names)
            if node.module.split(".")[0] not in repo_roots:
                index.used.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            index.chains.update(a.name for a in node.names)
            index.used.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if len(node.value) < 200:
                index.strings.add(node.value)
                if re.fullmatch(r"[\w.:/-]+", node.value):  # "mlp.linear_fc1.weight": its parts
                    index.strings.update(re.split(r"[.:/]", node.value))


def _files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".venv")]
        for name in filenames:
            yield Path(dirpath) / name
        for name in dirnames:
            yield Path(dirpath) / name


def _config_tree(index: CodeIndex, trees: dict[str, ast.Module]) -> None:
    """The keys of `RunConfig`, from the pydantic models' source: each section's fields,
    nested models followed by annotation, a `*_options` field's keys from the `Options` classes
    of the plug-ins in its registry's package."""
    fields: dict[str, dict[str, ast.AST]] = {}
    bases: dict[str, list[str]] = {}
    plugin_options: dict[str, set[str]] = {}  # module -> the classes its plug-ins name `Options`
    settings: dict[str, str] = {}  # registry setting -> package
    for dotted, tree in trees.items():
        if not dotted.startswith("miles_core."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own = {
                    item.target.id: item.annotation
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                }
                fields.setdefault(node.name, {}).update(own)
                bases.setdefault(node.name, []).extend(
                    (_chain(b) or "").rpartition(".")[2] for b in node.bases
                )
                for item in node.body:  # Options = PolicyOptions, or class Options(...)
                    if isinstance(item, ast.ClassDef) and item.name == "Options":
                        plugin_options.setdefault(dotted, set()).add(item.name)
                    elif (
                        isinstance(item, ast.Assign)
                        and any(getattr(t, "id", None) == "Options" for t in item.targets)
                        and isinstance(item.value, ast.Name)
                    ):
                        plugin_options.setdefault(dotted, set()).add(item.value.id)
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "Registry"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
            ):
                package = next((k.value for k in node.keywords if k.arg == "package"), None)
                if isinstance(package, ast.Constant):
                    settings[node.args[1].value] = package.value

    def all_fields(cls: str, seen=()) -> dict[str, ast.AST]:
        out: dict[str, ast.AST] = {}
        for b in bases.get(cls, []):
            if b in fields and b not in seen:
                out.update(all_fields(b, (*seen, cls)))
        out.update(fields.get(cls, {}))
        return out

    def walk(cls: str, prefix: str, depth: int = 0) -> None:
        if depth > 6:
            return
        for name, annotation in all_fields(cls).items():
            if name == "model_config":
                continue
            key = f"{prefix}{name}"
            index.config_keys.add(key)
            index.config_fields.add(name)
            text = ast.unparse(annotation)
            if "PluginOptionsField" in text:  # a plug-in's own settings
                package = settings.get(key.removesuffix("_options"), "\0")
                for module, classes in plugin_options.items():
                    if module.startswith(f"{package}."):
                        for options in classes:
                            walk(options, f"{key}.", depth + 1)
                continue
            if re.search(r"\b(dict|Mapping|Any)\b", text):
                index.config_free.add(key)
            for sub in re.findall(IDENT, text):
                if sub in fields and sub != cls and all_fields(sub):
                    walk(sub, f"{key}.", depth + 1)

    walk("RunConfig", "")


@functools.lru_cache(maxsize=1)
def code_index() -> CodeIndex:
    index = CodeIndex()
    trees: dict[str, ast.Module] = {}
    for top in CODE_DIRS:
        for path in _files(REPO / top):
            rel = path.relative_to(REPO).as_posix()
            index.paths.add(rel)
            if path.suffix != ".py" or not path.is_file():
                if path.is_dir():
                    index.defined.add(path.name)  # a package
                    index.short.setdefault(path.name, set()).add(rel.replace("/", "."))
                continue
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            dotted = ".".join(parts)
            index.defined.update(parts)
            index.short.setdefault(parts[-1], set()).add(dotted)
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            except (SyntaxError, UnicodeDecodeError):
                continue
            trees[dotted] = tree
            _index_module(tree, dotted, rel, index)
    for path in REPO.iterdir():
        index.paths.add(path.name)
    for name in BUILD_FILES:
        p = REPO / name
        if p.exists():
            index.paths.add(name)
            index.strings.update(re.findall(r"[A-Za-z_][\w.-]*", p.read_text()))
    for path in REPO.glob("docs/*"):
        index.paths.add(path.relative_to(REPO).as_posix())
    for name in sorted(index.paths):
        if name.endswith((".yaml", ".yml")):
            index.strings.update(re.findall(r"[A-Za-z_][\w.-]*", (REPO / name).read_text()))
    hooks = REPO / "docs" / "hooks.py"  # the site's generated pages
    _index_module(
        ast.parse(hooks.read_text(encoding="utf-8")), "docs.hooks", "docs/hooks.py", index
    )
    index.known |= {s for s in index.strings if re.fullmatch(IDENT, s)}
    index.known |= set(dir(builtins)) | set(keyword.kwlist)
    index.defined |= set(dir(builtins)) | set(keyword.kwlist)
    index.known |= index.defined | index.used
    index.folders = {part for p in index.paths for part in p.split("/")[:-1]}
    index.chains |= {c.rsplit(".", i)[0] for c in index.chains for i in range(c.count("."))}
    _config_tree(index, trees)
    return index


# ------------------------------------------------------------------------------ the doc's spans
def code_spans(text: str) -> list[tuple[int, str]]:
    """(line, content) of each inline code span outside fenced blocks."""
    lines = text.split("\n")
    fence: str | None = None
    kept: list[str] = []
    for line in lines:
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and marker:  # at any indent: fences nest in list items
            fence = marker.group(1)
            kept.append("")
        elif fence is not None:
            if stripped.startswith(fence) and not stripped[len(fence) :].strip(fence[0]).strip():
                fence = None
            kept.append("")
        else:
            kept.append(line)
    # blocks: paragraphs (up to a blank line) and single table rows
    blocks: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    for i, line in enumerate(kept):
        if not line.strip() or line.lstrip().startswith("|"):
            if current:
                blocks.append((start, "\n".join(current)))
                current = []
            if line.strip():
                blocks.append((i, line))
            continue
        if not current:
            start = i
        current.append(line)
    if current:
        blocks.append((start, "\n".join(current)))

    out: list[tuple[int, str]] = []
    for start, block in blocks:
        runs = [(m.start(), len(m.group())) for m in re.finditer(r"`+", block)]
        i = 0
        while i < len(runs):
            pos, n = runs[i]
            close = next((j for j in range(i + 1, len(runs)) if runs[j][1] == n), None)
            if close is None:
                i += 1
                continue
            content = block[pos + n : runs[close][0]].replace("\n", " ")
            if content.startswith(" ") and content.endswith(" ") and content.strip():
                content = content[1:-1]
            out.append((start + block.count("\n", 0, pos) + 1, content))
            i = close + 1
    return out


# ------------------------------------------------------------------------------------- checking
def _is_path(s: str) -> bool:
    return bool(re.fullmatch(r"[\w.\-/{},*]+", s)) and ("/" in s or s.endswith(SOURCE_EXTENSIONS))


def _expand(s: str) -> list[str]:
    """`a.{b,c}` → `a.b`, `a.c` (one brace group)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", s)
    if not m:
        return [s]
    return [s[: m.start()] + alt.strip() + s[m.end() :] for alt in m.group(1).split(",")]


def _path_exists(p: str, index: CodeIndex) -> bool:
    p = re.sub(r"^(\./|\.\./)+", "", p).rstrip("/")
    if not p:
        return True
    if p in index.paths:
        return True
    return any(x.endswith(f"/{p}") for x in index.paths)


def _source_path(p: str, index: CodeIndex) -> bool:
    """Whether a path names source (checked) rather than a run-time file."""
    if p.endswith(SOURCE_EXTENSIONS):
        return True
    first = re.sub(r"^(\./|\.\./)+", "", p).split("/")[0]
    return first in index.folders


def check_path(p: str, index: CodeIndex) -> list[str]:
    if re.search(r"[<>*]|\{[^,]*\}", p):
        return []  # a template
    problems = []
    for each in _expand(p):
        if _source_path(each, index) and not _path_exists(each, index):
            problems.append(f"no file {each}")
    return problems


def _files_named(p: str, index: CodeIndex) -> list[str]:
    p = re.sub(r"^(\./|\.\./)+", "", p)
    return [x for x in index.files if x == p or x.endswith(f"/{p}")]


def check_config_key(key: str, index: CodeIndex) -> bool:
    if key in index.config_keys:
        return True
    return any(key.startswith(f"{free}.") for free in index.config_free)


def _members(cls: str, index: CodeIndex, seen=()) -> tuple[set[str], bool]:
    """A class's members, its repo bases' included, and whether a base is outside the repo
    (pydantic's BaseModel, Exception, ...)."""
    out = set(index.classes.get(cls, set()))
    outside = False
    for base in index.bases.get(cls, set()):
        if base in ("object", "Protocol", "Generic", "ABC", "") or base in seen:
            continue
        if base not in index.classes:
            outside = True
            continue
        sub, sub_outside = _members(base, index, (*seen, cls))
        out |= sub
        outside |= sub_outside
    return out, outside


def check_name(name: str, index: CodeIndex) -> list[str]:
    """A plain or dotted code name (a module path, `Class.member`, `module.name`, ...)."""
    if name in ALLOWED or name in index.strings:
        return []
    parts = name.split(".")
    if parts[0] in PLACEHOLDERS:
        return []
    if len(parts) == 1:
        if name in index.defined or name in index.used:
            return []
        return [f"{name} is not defined in the code"]
    if name in index.chains:
        return []
    if name in index.modules:
        return []
    # module-qualified: miles_core.x.y.name
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if module in index.modules:
            if parts[i] in index.modules[module] or f"{module}.{parts[i]}" in index.modules:
                return []
            return [f"{module} has no {parts[i]}"]
    head, attr = parts[0], parts[1]
    if head in index.classes:  # Class.member
        members, outside = _members(head, index)
        if attr in members:
            return []
        if outside and not attr.startswith("_") and attr in index.used:
            return []  # inherited from outside (`model_dump`), as the code uses it
        return [f"{head} has no member {attr}"]
    for module in index.short.get(head, ()):  # module.name
        if attr in index.modules.get(module, ()):
            return []
    unknown = [p for p in parts[:-1] if p not in index.known]
    if unknown:
        return [f"{unknown[0]} (in {name}) is not a name of the code"]
    if parts[-1] in index.defined or parts[-1] in index.used:
        return []
    return [f"{parts[-1]} (in {name}) is not defined in the code"]


def check_value(v: str, index: CodeIndex) -> list[str]:
    """A config value or other word the code must know: a name or one of its strings."""
    v = v.strip().strip("\"'")
    if not v or v in LITERALS or re.fullmatch(r"[-+0-9.e_]+|[A-Za-z]", v) or v in ALLOWED:
        return []
    if v in index.strings:
        return []
    if re.fullmatch(IDENT, v):
        return check_name(v, index)
    if ":" in v and re.fullmatch(rf"{DOTTED.pattern}:{DOTTED.pattern}", v):
        return check_import_path(v, index)
    return []


def check_import_path(s: str, index: CodeIndex) -> list[str]:
    module, _, obj = s.partition(":")
    if module.split(".")[0] not in CODE_DIRS:
        return []  # another package's, or a placeholder (pkg.mod:Class)
    if module not in index.modules:
        return [f"no module {module}"]
    head = obj.split(".")[0]
    if head not in index.modules[module]:
        return [f"{module} has no {head}"]
    return []


def check_dotted_key(key: str, index: CodeIndex) -> list[str]:
    """A dotted lower-case name whose head is a config section: a config key, else a code
    name such as `tracking.check_tracking_uri` (a module of the same name)."""
    if check_config_key(key, index) or key in index.strings or key in ALLOWED:
        return []
    head, _, rest = key.partition(".")
    attr = rest.split(".")[0]
    for module in index.short.get(head, ()):
        if attr in index.modules.get(module, ()):
            return []
    return [f"{key} is not a config key"]


def _is_config_path(s: str, index: CodeIndex) -> bool:
    head = s.split(".")[0]
    return "." in s and head in index.config_keys and s == s.lower()


def check_span(span: str, index: CodeIndex) -> list[str]:
    """What is wrong with one code span (empty: fine, or not a reference)."""
    s = span.strip().replace("\\|", "|")
    if not s or s in ALLOWED or len(s) == 1:
        return []
    m = re.fullmatch(r"([\w.]+):\s+\S*://\S*", s)
    if m:
        return check_key(m.group(1), index)  # checkpoint.root: s3://...
    if "://" in s or s[0] in "/<[{~#0123456789%(…?:;,=" or re.match(r"-\d", s):
        return []  # a route, a template, a number, a payload
    if re.search(r"<[^<>\s]*>", s) or re.fullmatch(r"[0-9a-f]{7,40}", s):
        return []  # a template (<name>), a commit
    if s.startswith(".") and "/" not in s:
        return []  # a file suffix or an attribute alone
    if s.startswith("--"):  # a CLI flag, possibly `--set key=value`
        sets = re.findall(r"--set\s+([\w.]+)=(\S+)", s)
        return [p for k, v in sets for p in check_assignment(k, v, index)]
    if s.startswith("$"):
        s = re.match(r"\$?[\w]*", s).group().lstrip("$")
        return check_value(s, index) if s else []
    if s.startswith("@"):
        s = s[1:]
    if s.startswith('"') or s.startswith("'"):
        inner = s.strip("\"'")
        return check_value(inner, index) if re.fullmatch(r"[\w.-]+", inner) else []
    words = s.split()
    if words[0] in COMMANDS and len(words) > 1:
        return check_command(words, index)
    if s.startswith("async "):
        s = s[len("async ") :]
    if len(words) > 1 and _is_path(words[0]) and words[0].endswith(SOURCE_EXTENSIONS):
        return check_path(words[0], index)  # a script and its arguments
    if len(words) > 1 and all(re.fullmatch(r"[\w.]+=\S+", w) for w in words):
        return [p for w in words for p in check_assignment(*w.split("=", 1), index)]
    m = re.fullmatch(r"([\w.]+)\s*(?:→|->)\s*([\w.]+)", s)
    if m:  # EngineSetup → BuiltEngine
        return check_code(m.group(1), index) + check_code(m.group(2), index)

    # `path: name` / `path:name`
    m = re.fullmatch(r"([\w.\-/]+\.py):\s*([\w.]+)", s)
    if m:
        return check_path_name(m.group(1), m.group(2), index)
    if _is_path(s):
        if "/" in s and not s.endswith(SOURCE_EXTENSIONS) and not s.endswith("/"):
            head = s.split("/")[0]
            if head in METRIC_PREFIXES or head.lower() == head and "." not in head:
                if not _path_exists(s, index):
                    return []  # a metric name (train/loss) or a run-time path
        return check_path(s, index)
    # import path
    if re.fullmatch(rf"{DOTTED.pattern}:{DOTTED.pattern}", s):
        return check_import_path(s, index)
    # `key: value` (YAML) or `name: Type` (an annotation)
    m = re.fullmatch(r"([\w.]+):(?:\s+(.*))?", s)
    if m:
        key, value = m.group(1), (m.group(2) or "").strip()
        problems = check_key(key, index)
        if value and not value.startswith(("[", "{")) and "|" not in value:
            problems += check_value(value, index) if " " not in value else []
        return problems
    # comparisons and assignments
    m = re.fullmatch(r"([\w.]+)\s*(==|=|>|<|≥|≤|!=)\s*(.+)", s)
    if m and (" " not in m.group(3) or m.group(2) == "=="):
        if m.group(2) == "=":
            return check_assignment(m.group(1), m.group(3), index)
        return check_key(m.group(1), index) + check_operand(m.group(3), index)
    # a call: name(...), possibly `-> result`
    m = re.fullmatch(r"([\w.{},]+)\((.*)\)(\s*(->|→).*)?", s)
    if m:
        return [p for each in _expand(m.group(1)) for p in check_name(each, index)]
    # a record: Name{field, field}
    m = re.fullmatch(r"([A-Z]\w*[a-z]\w*)\{([\w, ]+)\}", s)
    if m:
        return check_code(m.group(1), index) + [
            p for f in m.group(2).split(",") for p in check_code(f"{m.group(1)}.{f.strip()}", index)
        ]
    # alternatives: Class.a/b, Name/Other, name(s)
    m = re.fullmatch(r"([\w.]+)\(s\)", s)
    if m:
        return check_code(m.group(1), index) + check_code(m.group(1) + "s", index)
    if re.fullmatch(r"[\w.]+(/[\w.]+)+", s):
        first, *others = s.split("/")
        if "." in first or first[0].isupper():
            names = [first]
            for other in others:
                if "." in first and "." not in other:
                    names.append(first.rsplit(".", 1)[0] + "." + other)
                else:  # GenerateInput/Output: the last capitalised word replaced
                    stem = re.sub(r"[A-Z][a-z0-9]*$", "", first)
                    names.append(stem + other)
            return [p for n in names for p in check_code(n, index)]
        return []  # a metric name
    # subscripts: Name[...]
    m = re.fullmatch(r"([\w.]+)\[([^\]]*)\]", s)
    if m:
        inner = m.group(2).strip("\"'")
        problems = check_code(m.group(1), index)
        if re.fullmatch(r"[A-Z]\w+", inner):
            problems += check_code(inner, index)
        return problems
    if re.fullmatch(r"[\w.]*[._]\{[\w, ]+\}[\w.]*", s) and "," in s:
        return [p for each in _expand(s) for p in check_code(each.replace(" ", ""), index)]
    if re.fullmatch(r"[\w.]+", s):
        return check_code(s, index)
    if re.fullmatch(r"[\w.-]+", s) and "-" in s:  # a name of a preset, a flow, a package
        if s in index.strings or any(s in x for x in index.strings):
            return []
        return [f"{s} is not a string of the code"]
    return []  # prose, formulas, payloads: not references


def check_code(s: str, index: CodeIndex) -> list[str]:
    s = s.strip(".")
    if not s or not re.fullmatch(r"[\w.]+", s) or s.isdigit():
        return []
    if s.startswith("_") and "." not in s and s.strip("_") == "":
        return []
    if _is_config_path(s, index) and s.split(".")[0] not in index.classes:
        return check_dotted_key(s, index)
    return check_name(s, index)


def check_key(key: str, index: CodeIndex) -> list[str]:
    """The left side of `key: value` / `key=value`: a config key, a field, or a code name."""
    if "." in key and _is_config_path(key, index):
        return check_dotted_key(key, index)
    if key in index.config_fields:
        return []
    if re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
        return check_value(key, index)
    return check_code(key, index)


def check_operand(v: str, index: CodeIndex) -> list[str]:
    v = v.strip()
    if re.fullmatch(r"[a-z_][\w]*(\.[a-z_]\w*)+", v):
        return check_key(v, index)
    return []


def check_assignment(lhs: str, rhs: str, index: CodeIndex) -> list[str]:
    problems = check_key(lhs, index)
    rhs = rhs.strip()
    if re.fullmatch(r"[\w.\-]+|\"[^\"]*\"|'[^']*'", rhs) and not re.fullmatch(r"[A-Z_]+", rhs):
        problems += check_value(rhs, index) if not rhs[0].isdigit() else []
    return problems


def check_command(words: list[str], index: CodeIndex) -> list[str]:
    """A shell command: the repo paths and modules it names."""
    problems = []
    for i, w in enumerate(words):
        if i and words[i - 1] == "-m" and re.fullmatch(DOTTED.pattern, w):
            if w.split(".")[0] in CODE_DIRS and w not in index.modules:
                problems.append(f"no module {w}")
        elif re.fullmatch(r"[\w.\-]+/[\w.\-/]+\.(py|yaml|md)", w):
            problems += check_path(w, index)
        elif i and words[i - 1] == "--set" and "=" in w:
            problems += check_assignment(*w.split("=", 1), index)
    return problems


def check_path_name(path: str, name: str, index: CodeIndex) -> list[str]:
    problems = check_path(path, index)
    if problems:
        return problems
    files = _files_named(path, index)
    head = name.split(".")[0]
    if files and not any(head in index.files[f] for f in files):
        return [f"{path} defines no {head}"]
    if "." in name:
        return check_code(name, index)
    return []


def check_text(text: str, source: str, index: CodeIndex) -> list[str]:
    """`source:line: `span`: why` for every span that names something the repo lacks."""
    out = []
    for line, span in code_spans(text):
        for problem in check_span(span, index):
            out.append(f"{source}:{line}: `{span}`: {problem}")
    return out


def doc_pages() -> list[Path]:
    return [REPO / "ARCHITECTURE.md"] + [
        p for p in sorted((REPO / "docs").glob("*.md")) if p.name != "log.md"
    ]


def check_docs(index: CodeIndex | None = None) -> list[str]:
    index = index or code_index()
    out = []
    for page in doc_pages():
        out += check_text(
            page.read_text(encoding="utf-8"), page.relative_to(REPO).as_posix(), index
        )
    return out


# ---------------------------------------------------------------------------------------- tests
def test_every_backticked_identifier_in_the_docs_exists():
    problems = check_docs()
    assert not problems, f"{len(problems)} names in the docs the repo lacks:\n" + "\n".join(
        problems
    )


def test_a_renamed_function_is_reported():
    """A function ARCHITECTURE.md names, taken out of the code's names as if renamed, is
    reported with its file and line; with the name in place the same text passes."""
    index = code_index()
    text = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    functions = {
        n.name
        for path in (REPO / "miles_core").rglob("*.py")
        for n in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
    }
    line, name = next((ln, s) for ln, s in code_spans(text) if s in functions)
    assert not [p for p in check_text(text, "ARCHITECTURE.md", index) if f"`{name}`" in p]
    found = check_text(text, "ARCHITECTURE.md", index.without(name))
    assert f"ARCHITECTURE.md:{line}: `{name}`: {name} is not defined in the code" in found

    # a method of a class, a module-qualified name, a config key and a path alike
    sample = (
        "`RLRuntime.update_weights`, `miles_core.run.training.build_trainer`,\n"
        "`rollout.engine_options.num_engines`, `rollout.engine_options.num_engine`,\n"
        "`weights/transport.py`, `weights/transports.py`, `TRANSPORTS.register(name)`"
    )
    assert check_text(sample, "x.md", index) == [
        "x.md:2: `rollout.engine_options.num_engine`: "
        "rollout.engine_options.num_engine is not a config key",
        "x.md:3: `weights/transports.py`: no file weights/transports.py",
    ]
    gone = index.without("update_weights").without("build_trainer").without("register")
    assert len(check_text(sample, "x.md", gone)) == 5
