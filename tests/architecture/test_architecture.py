"""The package's layers, as import edges: each unit (a subpackage or a top-level module of
graphdecode) may import only the units listed for it, the graph has no cycle, and the host side
speaks to the device side only through the executor (and the plan). Imports under
`if TYPE_CHECKING:` are annotations, not edges. Adding an edge is a design decision: make it
here, on purpose."""

from __future__ import annotations

import ast
import pathlib

import graphdecode

PACKAGE = pathlib.Path(graphdecode.__file__).parent

# unit -> the units it may import (top to bottom: front ends, host, the plan, device, model parts, leaves)
ALLOWED = {
    "cli": {"server", "bench", "engine_args", "host", "sampling_params"},
    "server": {"host", "device", "engine_args", "config", "structured", "sampling_params", "outputs",
               "default_model", "generation_defaults", "lora"},
    "bench": {"host", "cache", "config", "sampling_params", "default_model"},
    "host": {"device", "plan", "structured", "config", "engine_args", "outputs", "sampling_params", "default_model",
             "ranges", "lora"},
    "engine_args": {"config", "default_model", "launcher"},
    "config": {"models", "attention", "launcher", "generation_defaults", "lora"},
    "generation_defaults": {"models", "sampling_params"},
    "plan": {"sampling_params"},
    "device": {"plan", "attention", "models", "kernels", "cache", "ranges", "launcher", "lora"},
    "lora": {"models", "kernels"},  # PEFT adapters: their files, their device slots' layers
    "models": {"attention", "kernels"},
    "attention": {"kernels"},
    "kernels": {"cache"},
    "structured": {"cache"},
    "sampling_params": {"structured"},
    "default_model": {"cache"},
    "gguf_import": {"cache"},
    "outputs": set(),
    "cache": set(),
    "ranges": set(),
    "launcher": set(),
}
HOST_TO_DEVICE = {"graphdecode.device.executor"}  # the one door from the host into the device


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "graphdecode"


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, where) for every graphdecode import, lazy ones included."""
    public = graphdecode._PUBLIC  # `from graphdecode import LLM` imports what the lazy table names
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = module if rel.name == "__init__" else module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.lineno in skip:
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("graphdecode"):
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            if target == "graphdecode":
                for alias in node.names:
                    name = public.get(alias.name)
                    if name is not None:
                        out.append((module, "graphdecode" + name, where))
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").is_file():
                    out.append((module, sub, where))
                    break
            else:
                out.append((module, target, where))
    return out


def test_every_import_follows_the_layers():
    wrong = []
    for source, target, where in imports():
        a, b = _unit(source), _unit(target)
        if a == b or a == "graphdecode":
            continue
        assert a in ALLOWED, f"{where}: {a} is a new unit: give it its edges in ALLOWED"
        if b not in ALLOWED[a]:
            wrong.append(f"{where}: {a} -> {b} ({target})")
    assert not wrong, "imports outside the layers:\n" + "\n".join(wrong)


def test_the_host_enters_the_device_only_through_the_executor():
    wrong = [f"{where}: {target}" for source, target, where in imports()
             if _unit(source) == "host" and _unit(target) == "device" and target not in HOST_TO_DEVICE]
    assert not wrong, "\n".join(wrong)


def test_the_units_form_no_cycle():
    graph = {unit: set(edges) for unit, edges in ALLOWED.items()}
    done, stack = set(), []

    def visit(unit):
        if unit in stack:
            raise AssertionError("cycle: " + " -> ".join(stack[stack.index(unit):] + [unit]))
        if unit in done:
            return
        stack.append(unit)
        for nxt in graph.get(unit, ()):
            visit(nxt)
        stack.pop()
        done.add(unit)

    for unit in graph:
        visit(unit)


def test_no_module_imports_itself_in_a_circle():
    """Within the package, module to module (a circle of modules inside one unit is a circle too)."""
    graph: dict[str, set[str]] = {}
    for source, target, _ in imports():
        graph.setdefault(source, set()).add(target)
    done, stack = set(), []

    def visit(module):
        if module in stack:
            cycle = stack[stack.index(module):] + [module]
            raise AssertionError("module cycle: " + " -> ".join(cycle))
        if module in done:
            return
        stack.append(module)
        for nxt in sorted(graph.get(module, ())):
            if nxt in graph or nxt.rsplit(".", 1)[0] in graph:
                visit(nxt)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
