"""The package's architecture, checked: no import cycle, dependencies that point one way, a registry
that agrees with the drafters it names, and a config that loads without torch."""
import ast
import inspect
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nanospec"
# what each part may import from nanospec (itself always): rl -> engine -> models, drafters see the
# engine's interfaces (sequence, runner, sampler) only, config and the registry sit below everything
ALLOWED = {
    "nanospec.config": {"nanospec.drafters.registry"},
    "nanospec.drafters.registry": {"nanospec.drafters"},    # build() imports the builders lazily
    "nanospec.models": {"nanospec.config"},
    "nanospec.drafters": {"nanospec.config", "nanospec.models", "nanospec.engine.sequence",
                          "nanospec.engine.runner", "nanospec.engine.sampler"},
    "nanospec.engine": {"nanospec.config", "nanospec.models", "nanospec.drafters"},
    "nanospec.tasks": {"nanospec.config", "nanospec.models"},
    "nanospec.rl": {"nanospec"},
}


def import_graph() -> dict[str, set[str]]:
    """module -> the nanospec modules it imports, at any depth of the file (a lazy import inside a
    function is still a dependency)."""
    files = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PKG.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names}
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


def test_no_import_cycle():
    graph, state, stack = import_graph(), {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        state[m] = "done"
        stack.pop()
    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_dependencies_point_one_way():
    def part(m):
        return max((p for p in ALLOWED if m == p or m.startswith(p + ".")), key=len, default=None)
    bad = []
    for m, deps in import_graph().items():
        p = part(m)
        if p is None:
            continue
        for d in deps:
            if part(d) != p and not any(d == a or d.startswith(a + ".") for a in ALLOWED[p]):
                bad.append(f"{m} imports {d}")
    assert not bad, bad


def test_the_package_imports_no_tool():
    """tools/ (report, simulate, soak) and benchmarks/ read runs or time the package: the package never
    imports them, so a fork can drop them."""
    bad = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(PKG.parent)} imports {n}" for n in names
                    if n.split(".")[0] in ("tools", "benchmarks", "bench", "train", "eval")]
    assert not bad, bad


def test_config_and_registry_import_without_torch():
    code = "import sys, nanospec.config, nanospec.drafters.registry; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PKG.parent)


def test_allowed_values_are_defined_once():
    """config.py names the allowed values; the modules that act on them agree (a new dtype or
    architecture is added in both places or this fails). Each task in config.TASKS imports, and reads
    only config knobs its constructor takes."""
    from nanospec import config
    from nanospec.models.decoder import SUPPORTED
    from nanospec.models.loader import DTYPES
    from nanospec.tasks import task_class
    assert SUPPORTED is config.ARCHS and tuple(DTYPES) == config.DTYPES
    knobs = {f.name for f in fields(config.TaskConfig)}
    for name in config.TASKS:
        assert set(inspect.signature(task_class(name)).parameters) <= knobs, name


def test_registry_options_are_the_builders_keywords():
    """Each method's options are exactly its builder's keyword arguments (their defaults live there)."""
    from nanospec.drafters import registry
    from nanospec.drafters.suffix_mlp import SuffixMLPDrafter
    for name, method in registry.METHODS.items():
        params = inspect.signature(registry.load(name)).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):      # suffix_mlp passes its class's own
            params = {**params, **inspect.signature(SuffixMLPDrafter).parameters}
        accepted = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD} - {"target", "vocab_size"}
        assert set(method.options) == accepted, name
        builder = registry.load(name)        # a Drafter class, or a function annotated to return one
        built = builder if isinstance(builder, type) else typing.get_type_hints(builder)["return"]
        assert method.own_kv == built.needs_kv, name           # the engine sizes its KV pool by it


def test_the_readmes_token_path_names_what_exists():
    """Every `dir/module.Name.attr` (or `dir/file.py`) the README's "One token, from prompt to loss"
    section cites resolves in the package, so a reader following it never looks for a function that
    is not there (it once started at `Trainer.step()`, an int)."""
    import importlib
    import re
    readme = (PKG.parent / "README.md").read_text()
    section = readme.split("## One token, from prompt to loss", 1)[1].split("\n## ", 1)[0]
    cited = sorted(set(re.findall(r"\b[a-z_]+/[a-z_]+(?:\.[A-Za-z_]+)+", section)))
    assert len(cited) > 15, cited
    missing = []
    for name in cited:
        path, _, rest = name.partition(".")
        if rest == "py":
            if not (PKG / f"{path}.py").is_file():
                missing.append(name)
            continue
        obj = importlib.import_module("nanospec." + path.replace("/", "."))
        for attr in rest.split("."):
            obj = getattr(obj, attr, None)
        if obj is None:
            missing.append(name)
    assert not missing, missing
