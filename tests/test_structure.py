"""The package's structure, read from the source with `ast` (nothing is imported): no module uses another
module's private names, the library (sbd_jax/) never imports the demos (demos/), the modules import each other
without cycles (imports inside functions count,
and so do `if TYPE_CHECKING:` ones), no function is longer than 60 lines and no module longer than 400."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "sbd_jax", ROOT / "demos")  # the library, and the demos that use it
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 60, 400
# namedtuple's API: public although spelled with an underscore
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for pkg in PACKAGES for p in sorted(pkg.rglob("*.py"))}
TREES = {name: ast.parse(p.read_text(), str(p)) for name, p in MODULES.items()}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__") and name not in NAMEDTUPLE_API


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of the module an ImportFrom reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")[:len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str):
    """(imported sbd_jax module, (local name, the module object bound to it) or None, names taken from it) for every
    import statement of `module`, wherever it is. `from pkg import sub` gives the submodule `pkg.sub`."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:  # `import a.b` binds `a`, `import a.b as x` binds `a.b`
                    top = a.name.partition(".")[0]
                    yield a.name, (a.asname, a.name) if a.asname else (top, top), ()
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if source not in MODULES:
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                if sub in MODULES:
                    yield sub, (a.asname or a.name, sub), ()
                else:
                    yield source, None, (a.name,)


def _dotted(node) -> str | None:
    """`a.b.c` of an expression made of names and attributes only; None otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return head and f"{head}.{node.attr}"
    return None


def test_no_module_uses_another_modules_private_names():
    bad = []
    for module in MODULES:
        aliases = {}  # local name -> the sbd_jax module object it is bound to
        for source, binding, names in _imports(module):
            bad += [f"{module} imports {n} from {source}" for n in names if _private(n)]
            if binding:
                aliases[binding[0]] = binding[1]
        for node in ast.walk(TREES[module]):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                head, _, rest = (_dotted(node.value) or "").partition(".")
                target = aliases.get(head, "") + (f".{rest}" if rest else "")
                if target in MODULES and target != module:
                    bad.append(f"{module}:{node.lineno} reads {target}.{node.attr}")
    assert not bad, "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_library_does_not_import_the_demos():
    bad = [f"{m} imports {source}" for m in MODULES if m.startswith("sbd_jax")
           for source, _, _ in _imports(m) if source.startswith("demos")]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = {m: {source for source, _, _ in _imports(m)} - {m} for m in MODULES}
    cycles = _cycles(edges)
    assert not cycles, "import cycles among sbd_jax modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_size_limits():
    bad = []
    for module, path in MODULES.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            bad.append(f"{path.relative_to(ROOT)}: {lines} lines (limit {MAX_MODULE_LINES})")
        for node in ast.walk(TREES[module]):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    bad.append(f"{path.relative_to(ROOT)}::{node.name}: {n} lines (limit {MAX_FUNCTION_LINES})")
    assert not bad, "\n".join(bad)


def _class_fields(module: str, cls: str) -> list[str]:
    """The annotated fields of class `cls` in `module` (a NamedTuple's)."""
    node = next(n for n in ast.walk(TREES[module]) if isinstance(n, ast.ClassDef) and n.name == cls)
    return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]


def _attributes_read(modules) -> set[str]:
    return {n.attr for m in modules for n in ast.walk(TREES[m]) if isinstance(n, ast.Attribute)}


def test_each_mode_owns_its_state():
    """The decode loop's shared state holds only what every mode and the shared code use; a mode's own fields live
    in its `mode_state` (AR's, SBD's, verify's NamedTuples), which only the modes read: the shared code (loop,
    outputs, continuous batching) reaches a mode through its hooks, and reads every shared field itself."""
    shared = _class_fields("sbd_jax.decoding.state", "LoopState")
    own = {cls: _class_fields(m, cls) for m, cls in (("sbd_jax.decoding.modes.ar", "ARState"),
                                                     ("sbd_jax.decoding.modes.sbd", "SBDState"),
                                                     ("sbd_jax.decoding.modes.verify.state", "VerifyState"))}
    for cls, fields in own.items():
        assert not set(fields) & set(shared), f"{cls} repeats loop-state fields {set(fields) & set(shared)}"
    outside = [m for m in MODULES if m.startswith("sbd_jax.decoding") and ".modes" not in m]
    read = _attributes_read(outside)
    assert "mode_state" not in read, "shared decoding code reads a mode's state directly (use the Mode hooks)"
    unused = [f for f in shared if f != "mode_state" and f not in read]
    assert not unused, f"loop-state fields no shared code reads (a mode's own: move them to its state): {unused}"
    verify_only = set(own["VerifyState"]) - set(own["SBDState"])
    others = [m for m in MODULES if m.startswith("sbd_jax.decoding.modes") and ".verify" not in m]
    leaked = verify_only & _attributes_read(others)
    assert not leaked, f"verify's own fields read outside modes/verify: {leaked}"
