"""The package layering (ARCHITECTURE.md, "imports point down only"), checked on the source.

Every module under ketch/ is parsed with `ast`; every import of a ketch module (at the top, inside
a function, under TYPE_CHECKING, relative or absolute) is an edge between two packages, a package
being ketch/<pkg>/ or a top-level module (ketch/config.py is `config`, ketch/__init__.py is
`ketch`). Each edge must be in ALLOWED or in PENDING_REMOVAL; each pending edge must still exist
(the list only shrinks); the packages may not import each other in a cycle.

    cli ─┬─▶ gateway (speaks HTTP to servers; imports no other package but http_shutdown, request_id,
         │           instance_id)
         ├─▶ server ──▶ engine ──▶ scheduler ──▶ cache ──────────────────────▶ kernels (page copy)
         │   (parsers)     │ ├──────▶ disagg (PD KV transport)
         │                 │ └──────▶ runner ──▶ models ──▶ layers ──▶ kernels, native (C, CPU)
    bench┘                 │            └──▶ attention ──────────────▶ kernels
                     sampling: below engine, scheduler and runner (──▶ kernels: argmax)
    leaves anything may import: config, forward_batch, weights, text, host_copy, user_cache (low
    packages: config, forward_batch, host_copy, kv_dtype, user_cache only)
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

KETCH = Path(__file__).resolve().parent.parent / "ketch"

# What any package from sampling/scheduler upwards may import: formats, text, small helpers.
LEAVES = frozenset({"config", "cpu_bf16", "forward_batch", "hf_config", "host_copy", "host_memory", "kv_dtype", "text",
                    "user_cache", "weights"})
# What the packages at the bottom may import: no file format, no text.
LOW_LEAVES = frozenset({"config", "forward_batch", "host_copy", "host_memory", "kv_dtype", "user_cache"})

# package -> the packages it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    "ketch": frozenset({"llm", "sampling"}),  # the root: `ketch.LLM`, `ketch.SamplingParams`
    "cli": frozenset({"bench", "cli_args", "gateway", "llm", "server"}) | LEAVES,
    # the router talks to `ketch serve` over HTTP only: no engine, no server code; both stop
    # uvicorn the same way (http_shutdown: the deadline's answers, exit 0 on SIGTERM)
    "gateway": frozenset({"http_shutdown", "instance_id", "request_id"}),
    "cli_args": frozenset({"sampling"}) | LEAVES,  # engine flags, shared by cli and bench
    "bench": frozenset({"cli_args", "engine", "sampling", "server"}) | LEAVES,  # beside cli
    "llm": frozenset({"engine", "sampling"}) | LEAVES,  # the in-process API, beside server
    "server": frozenset({"engine", "http_shutdown", "instance_id", "parsers", "request_id", "sampling"}) | LEAVES,
    "parsers": LEAVES,  # below server, beside text
    # models: the config; parallel: the engine starts the TP ranks and hands each its context
    # instance_id: the engine draws its server's id at start
    "engine": frozenset({"cache", "disagg", "instance_id", "models", "parallel", "runner", "sampling", "scheduler",
                         "spec"}) | LEAVES,
    # proposers guess (draft: its own runner and cache; block: a head built of the models' layers)
    "spec": frozenset({"cache", "layers", "runner", "sampling"}) | LEAVES,
    "disagg": LOW_LEAVES,  # PD transport: moves the pool's tensors it is handed; no scheduler, no cache code
    "scheduler": frozenset({"cache", "sampling"}) | LEAVES,
    "sampling": frozenset({"kernels"}) | LEAVES,  # the greedy pick's argmax kernel on CUDA
    "runner": frozenset({"attention", "cache", "layers", "models", "parallel", "sampling"}) | LEAVES,
    "models": frozenset({"attention", "layers", "parallel"}) | LEAVES,  # a model calls the attention contract
    "attention": frozenset({"cache", "kernels", "native"}) | LOW_LEAVES,  # the backends read the KV pool
    "cache": frozenset({"kernels"}) | LOW_LEAVES,  # the host tier's page-copy kernel (IO backend "kernel")
    "layers": frozenset({"kernels", "native", "parallel"}) | LOW_LEAVES,  # ops.py picks kernel or torch
    "native": frozenset({"user_cache"}),  # the CPU's C kernels, built into the user cache
    "parallel": LOW_LEAVES,  # ParallelContext: handed to models and their layers, imports neither
    "kernels": LOW_LEAVES,  # no layers/ or cache/ module: references live in tests or above
    # the leaves themselves
    "config": frozenset({"config_checks", "cpu_bf16", "hf_config"}),  # its checks; config.json's fields; CPU dtype
    "config_checks": frozenset(),
    "cpu_bf16": frozenset(),  # whether the CPU runs bf16 natively
    "forward_batch": frozenset(),  # one step as plain data: engine builds it, runner and backends read it
    "host_copy": frozenset(),
    "hf_config": frozenset(),  # a config.json's fields checked, the sliding window derived
    "host_memory": frozenset(),
    "request_id": frozenset(),  # the x-request-id of `ketch serve` and `ketch gateway` alike
    "instance_id": frozenset(),  # the x-ketch-instance a server sends and the gateway reads
    "http_shutdown": frozenset(),  # uvicorn's graceful shutdown as `ketch serve` and `ketch gateway` run it
    "kv_dtype": frozenset(),  # the KV pages' element type, shared by cache/ and kernels/
    "text": frozenset({"config", "user_cache", "weights"}),  # a tokenizer can come out of a GGUF file
    "user_cache": frozenset(),  # where rebuildable things live (XDG)
    "weights": frozenset({"config", "layers"}),  # gguf_q4.py fills layers.q4.Q4Weight
}

# Edges the target forbids that the engine-core refactor (ForwardBatch, issue 14) takes out. The
# test fails once one is gone: delete it here then, so the list only shrinks.
PENDING_REMOVAL: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class Edge:
    path: str  # the importing file, from the tree's parent: ketch/kernels/x.py
    line: int
    source: str  # its package
    target: str  # the imported module's package
    module: str  # the imported module, as resolved

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} -> {self.target} (import {self.module})"


def package_of(module: str, root: Path) -> str | None:
    """'ketch.kernels.x' -> 'kernels', 'ketch.config' -> 'config', 'ketch' -> 'ketch'; None: not ours."""
    parts = module.split(".")
    if parts[0] != root.name:
        return None
    return parts[1] if len(parts) > 1 else root.name


def _module_parts(path: Path, root: Path) -> tuple[list[str], bool]:
    """The dotted name of a file, and whether it is a package's __init__."""
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        return parts[:-1], True
    return parts, False


def _imported_modules(node: ast.Import | ast.ImportFrom, path: Path, root: Path) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module.split(".") if node.module else []
    if node.level:  # relative: from the file's package, one level up per extra dot
        parts, is_package = _module_parts(path, root)
        package = parts if is_package else parts[:-1]
        base = package[: len(package) - (node.level - 1)] + base
    if base == [root.name]:  # `from ketch import x`: a module when there is one, else the root's name
        return [f"{root.name}.{a.name}" if (root / a.name).is_dir() or (root / f"{a.name}.py").is_file()
                else root.name for a in node.names]
    return [".".join(base)]


def edges_in(root: Path) -> tuple[list[Edge], set[str]]:
    """Every import of a ketch module by a module of another package; and every package seen."""
    edges, packages = [], set()
    for path in sorted(root.rglob("*.py")):
        parts, _ = _module_parts(path, root)
        source = package_of(".".join(parts), root)
        packages.add(source)
        rel = path.relative_to(root.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):  # walk: function bodies too
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for module in _imported_modules(node, path, root):
                target = package_of(module, root)
                if target is not None and target != source:
                    edges.append(Edge(rel, node.lineno, source, target, module))
    return edges, packages


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) per strongly connected group of two or more packages (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for group in groups:  # the shortest way from the group's first member back to it
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in [n for f in frontier for n in graph.get(f, ())]:
            nxt = []
            for f in frontier:
                for n in sorted(graph.get(f, ())):
                    if n in group and n not in paths:
                        paths[n] = paths[f] + [n]
                        nxt.append(n)
            frontier = nxt
        last = next(f for f in frontier if start in graph.get(f, ()))
        cycles.append(paths[last] + [start])
    return cycles


def check_layering(root: Path, allowed: dict[str, frozenset[str]],
                   pending: frozenset[tuple[str, str]]) -> list[str]:
    """Everything wrong with the imports under `root`, one line each naming file, line and edge."""
    edges, packages = edges_in(root)
    problems = [f"{root.name}/{p}: package `{p}` is not in the table of allowed edges"
                for p in sorted(packages - allowed.keys())]
    problems += [f"pending edge {a} -> {b} is also allowed: keep it in one table"
                 for a, b in sorted(pending) if b in allowed.get(a, ())]
    seen: dict[tuple[str, str], Edge] = {}
    for edge in edges:
        seen.setdefault((edge.source, edge.target), edge)
        if edge.source not in allowed or (edge.source, edge.target) in pending:
            continue
        if edge.target not in allowed:
            problems.append(f"{edge}: package `{edge.target}` is not in the table of allowed edges")
        elif edge.target not in allowed[edge.source]:
            problems.append(f"{edge}: not an allowed edge")
    problems += [f"pending edge {a} -> {b} no longer exists: remove it from PENDING_REMOVAL"
                 for a, b in sorted(pending - seen.keys())]
    graph: dict[str, set[str]] = {}
    for a, b in seen:
        graph.setdefault(a, set()).add(b)
    for cycle in find_cycles(graph):
        where = "; ".join(str(seen[a, b]) for a, b in zip(cycle, cycle[1:]))
        problems.append(f"import cycle {' -> '.join(cycle)}: {where}")
    return problems


# ---------------------------------------------------------------- the tree as it is
def test_ketch_keeps_the_layering():
    problems = check_layering(KETCH, ALLOWED, PENDING_REMOVAL)
    assert not problems, "\n".join(problems)


def test_the_table_itself_is_a_layering():
    """No cycle among the allowed edges either: the table orders the packages."""
    graph = {a: set(bs) for a, bs in ALLOWED.items()}
    assert find_cycles(graph) == []
    assert not {b for bs in ALLOWED.values() for b in bs} - ALLOWED.keys()


def test_the_rules_of_the_issue_are_in_the_table():
    """What issue 14 states, against the table (so a widened table shows here too)."""
    assert not {"layers", "cache", "attention", "models", "weights", "text"} & ALLOWED["kernels"]
    assert "weights" not in ALLOWED["layers"] and "layers" in ALLOWED["weights"]
    for low, high in [("cache", "scheduler"), ("scheduler", "engine"), ("engine", "server"), ("kernels", "layers"),
                      ("layers", "models"), ("parallel", "layers"), ("parallel", "models"), ("models", "runner"), ("runner", "engine"), ("sampling", "engine"),
                      ("sampling", "runner"), ("text", "server"), ("parsers", "server"),
                      ("disagg", "engine"), ("scheduler", "disagg"), ("cache", "disagg")]:
        assert high not in ALLOWED[low], f"{low} may import {high}, the layer above it"
    assert [p for p, bs in ALLOWED.items() if "bench" in bs] == ["cli"]


# ---------------------------------------------------------------- the checker can fail
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A fake ketch/ package tree with `files` (path -> source) and an __init__.py per folder."""
    root = tmp_path / "ketch"
    for rel, source in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in [path.parent, *path.parent.parents]:
            if folder == root.parent:
                break
            (folder / "__init__.py").touch()
        path.write_text(source)
    return root


def test_a_kernel_importing_the_server_is_reported(tmp_path):
    root = _tree(tmp_path, {"kernels/x.py": '"""A kernel."""\nimport torch\nimport ketch.server.app\n',
                            "server/app.py": ""})
    problems = check_layering(root, ALLOWED, frozenset())
    assert problems == ["ketch/kernels/x.py:3: kernels -> server (import ketch.server.app): not an allowed edge"]


def test_imports_in_functions_under_type_checking_and_relative_ones_count(tmp_path):
    root = _tree(tmp_path, {
        "layers/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ketch.engine.engine import Engine\n",
        "layers/b.py": "def f():\n    from ..weights import gguf_q4\n",
        "layers/c.py": "from ketch import scheduler\nfrom ketch import SamplingParams\n",
        "engine/engine.py": "", "weights/gguf_q4.py": "", "scheduler/__init__.py": "",
    })
    edges = sorted(str(e) for e in check_layering(root, ALLOWED, frozenset()))
    assert edges == [
        "ketch/layers/a.py:3: layers -> engine (import ketch.engine.engine): not an allowed edge",
        "ketch/layers/b.py:2: layers -> weights (import ketch.weights): not an allowed edge",
        "ketch/layers/c.py:1: layers -> scheduler (import ketch.scheduler): not an allowed edge",
        "ketch/layers/c.py:2: layers -> ketch (import ketch): not an allowed edge",
    ]


def test_a_cycle_and_an_unknown_package_are_reported(tmp_path):
    root = _tree(tmp_path, {"cache/a.py": "import ketch.scheduler.b\n", "scheduler/b.py": "import ketch.cache.a\n",
                            "router/g.py": "import ketch.server\n", "server/__init__.py": ""})
    problems = check_layering(root, ALLOWED, frozenset())
    assert problems == [
        "ketch/router: package `router` is not in the table of allowed edges",
        "ketch/cache/a.py:1: cache -> scheduler (import ketch.scheduler.b): not an allowed edge",
        "import cycle cache -> scheduler -> cache: ketch/cache/a.py:1: cache -> scheduler (import ketch.scheduler.b); "
        "ketch/scheduler/b.py:1: scheduler -> cache (import ketch.cache.a)",
    ]


def test_a_pending_edge_passes_while_it_exists_and_fails_once_gone(tmp_path):
    pending = frozenset({("runner", "scheduler")})
    root = _tree(tmp_path, {"runner/r.py": "from ketch.scheduler.s import ScheduledChunk\n", "scheduler/s.py": ""})
    assert check_layering(root, ALLOWED, pending) == []
    (root / "runner/r.py").write_text("")
    assert check_layering(root, ALLOWED, pending) == [
        "pending edge runner -> scheduler no longer exists: remove it from PENDING_REMOVAL"]
