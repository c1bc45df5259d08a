"""The layout a newcomer relies on, checked: floors without a circle, exchanges as values, one spec,
short functions, public names across package boundaries.

Exchange names appear as strings only in ``jax_cp/exchanges/`` (which also holds
the one place that converts them); the grouped-query message exists once; the
per-shard body stays a readable page.
"""
import ast
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_cp
from util import child_env

ROOT = pathlib.Path(jax_cp.__file__).parent
REPO = ROOT.parent
NAMES = set(jax_cp.exchanges.NAMES)


def _files(*dirs):
    for d in dirs:
        yield from sorted((REPO / d).rglob("*.py"))


def _functions(path):
    """``(name, lines)`` of every function, its docstring not counted (an ``Args:`` entry per
    parameter is documentation, not logic)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0]
            doc = first.end_lineno - first.lineno + 1 if isinstance(first, ast.Expr) and isinstance(
                getattr(first, "value", None), ast.Constant) and isinstance(first.value.value, str) else 0
            yield node.name, node.end_lineno - node.lineno + 1 - doc


def test_exchange_names_live_only_in_the_exchange_folder():
    found = []
    for path in _files("jax_cp", "models"):
        if ROOT / "exchanges" in path.parents:
            continue
        text = path.read_text()
        found += [f"{path.relative_to(REPO)}: {q}{n}{q}" for n in NAMES for q in "\"'" if f"{q}{n}{q}" in text]
    assert not found, found


def test_grouped_query_message_exists_once():
    hits = [p for p in _files("jax_cp", "models") if "is not a multiple of num_kv_heads" in p.read_text()]
    assert [p.relative_to(REPO).as_posix() for p in hits] == ["jax_cp/_params.py"]


def test_functions_are_short():
    long = [f"{p.relative_to(REPO)}:{name} ({n} lines)" for p in _files("jax_cp") if "plan" not in p.parts
            for name, n in _functions(p) if n > 50]
    assert not long, long
    body = dict(_functions(ROOT / "_body.py"))["attention_shard"]
    layer = dict(_functions(ROOT / "_layer.py"))["_layer_shard"]
    assert body + layer <= 30, (body, layer)


def test_example_model_uses_the_library():
    src = (REPO / "models" / "llama.py").read_text()
    tree = ast.parse(src)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & {"_place", "place", "rms_norm"}, defined
    assert "set_value" not in src and "set_metadata" not in src  # no CPAttention parameter rewritten afterwards


# The floors of jax_cp, ground first: a module imports modules of its own floor or lower ones only
# (imports inside functions included), and no import circle closes anywhere.
FLOORS = (
    ("facts and metadata", ("_platform", "_chips", "_checks", "_masks", "_meta", "_params", "_posenc", "_ulysses", "_mesh",
                            "_softmax", "_vma", "_remat")),
    ("kernels", ("kernels",)),
    ("per-shard steps", ("exchanges", "_projection", "load_balance", "_dispatch")),
    ("the rule", ("_defaults", "_spec")),
    ("entry points", ("_body", "_layer", "_attention", "_decode", "reference")),
    ("linear", ("linear",)),
    ("flax faces", ("_module", "linen", "__init__")),
    ("the planner", ("plan",)),
)
FLOOR = {name: i for i, (_, names) in enumerate(FLOORS) for name in names}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path):
    """The jax_cp modules ``path`` imports, anywhere in it (a function's body too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "jax_cp")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "jax_cp":
            for a in node.names:  # ``from jax_cp import _kernels`` names a module; ``import CPAttention`` the face
                sub = f"{node.module}.{a.name}"
                is_module = (REPO / sub.replace(".", "/")).with_suffix(".py").exists() or (REPO / sub.replace(".", "/")).is_dir()
                yield sub if is_module else node.module


def _room(module: str) -> str:
    """A module's place in FLOORS: its first name below jax_cp (``jax_cp`` itself: ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): set(_imports(p)) - {_module_name(p)} for p in _files("jax_cp")}


def test_every_module_has_a_floor():
    assert {_room(m) for m in _graph()} <= set(FLOOR), sorted({_room(m) for m in _graph()} - set(FLOOR))


def test_imports_go_down_or_along_never_up():
    up = [f"{m} (floor {FLOORS[FLOOR[_room(m)]][0]!r}) imports {t} (floor {FLOORS[FLOOR[_room(t)]][0]!r})"
          for m, targets in _graph().items() for t in sorted(targets) if FLOOR[_room(t)] > FLOOR[_room(m)]]
    assert not up, up


def test_the_reference_stands_on_the_ground_floor():
    """The ground truth shares only facts (metadata, parameter shapes, RoPE) and the dense kernel's
    plain attention with the code it checks: nothing else of the kernels, nor the exchanges or the layer."""
    imports = _graph()["jax_cp.reference"]
    assert "jax_cp.kernels._dense" in imports
    rest = imports - {"jax_cp.kernels._dense"}
    assert rest and all(FLOOR[_room(m)] == 0 for m in rest), sorted(rest)
    assert _graph()["jax_cp.kernels._dense"] <= {m for m in _graph() if FLOOR[_room(m)] == 0}


def test_kernel_code_lives_in_the_kernel_room():
    """Each kernel's implementation sits in ``kernels/`` beside its value; what the exchanges and
    decode share with the kernels (softmax pieces, vma typing) stands on the ground floor."""
    outside = [p.name for p in ROOT.glob("_*.py") if p.stem in ("_blockwise", "_splash", "_pallas_gpu", "_dense")]
    assert not outside, outside
    for name in ("_blockwise", "_splash", "_pallas_gpu", "_dense"):
        assert (ROOT / "kernels" / f"{name}.py").exists(), name
    for helper in ("varying_sinks", "check_soft_cap", "fold_sinks", "merge_softmax"):
        assert helper in jax_cp._softmax.__all__
    assert "vma" in jax_cp._vma.__all__


def test_the_import_graph_has_no_circle():
    graph, state, path = _graph(), {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_an_auto_call_does_not_import_the_planner():
    code = """
import sys, jax
jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp
from flax import nnx
import jax_cp
m = jax_cp.CPAttention(4, 16, mesh=jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2), is_causal=True, rngs=nnx.Rngs(0))
y = m(jnp.ones((1, 8, 16)))
print(jax_cp.describe_kernel(), sorted(k for k in sys.modules if k.startswith("jax_cp.plan")))
"""
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("[]"), out.stdout


def _code_of(path: pathlib.Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    lines = [l for c in cells if c["cell_type"] == "code" for l in "".join(c["source"]).splitlines()]
    return "\n".join(l for l in lines if not l.lstrip().startswith(("%", "!")))


def _private_uses(path: pathlib.Path):
    for node in ast.walk(ast.parse(_code_of(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jax_cp":
            names = node.module.split(".") + [a.name for a in node.names]
            yield from (f"from {node.module} import {a.name}" for a in node.names
                        if any(n.startswith("_") and not n.startswith("__") for n in names))
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "jax_cp" and "._" in a.name)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id == "jax_cp":
                yield ast.unparse(node)


def test_models_benchmarks_and_notebooks_use_public_names_only():
    paths = [*_files("models", "benchmarks"), *sorted((REPO / "notebooks").glob("*.ipynb"))]
    found = [f"{p.relative_to(REPO)}: {use}" for p in paths for use in _private_uses(p)]
    assert not found, found


PER_SHARD = ("_body.py", "_projection.py", "_decode.py", "_layer.py", "_softmax.py", "_vma.py",
             "kernels", "_ulysses.py", "exchanges")
MUTATORS = {"append", "extend", "insert", "pop", "update", "setdefault", "add", "clear", "remove"}


def _mutations(path: pathlib.Path):
    """``Class.method: what`` for every method but the constructors that assigns to ``self.<name>`` or
    calls a mutating method on one of its attributes."""
    for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name not in ("__init__", "__post_init__")):
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in (e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        yield f"{cls.name}.{fn.name}: self.{t.attr} = ..."
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                    owner = node.func.value
                    if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self":
                        yield f"{cls.name}.{fn.name}: self.{owner.attr}.{node.func.attr}(...)"


def test_no_per_shard_class_holds_state_that_traced_code_mutates():
    paths = [p for p in _files("jax_cp") if any(part in PER_SHARD for part in p.relative_to(ROOT).parts)]
    assert len(paths) >= 12, paths
    found = [f"{p.relative_to(REPO)}: {m}" for p in paths for m in _mutations(p)]
    assert not found, found


def test_the_body_is_driven_by_frozen_pytrees():
    """What the per-shard body is handed (the layer's chunked weights, dot_product_attention's q, k,
    v) is a frozen dataclass registered as a pytree: flattened and rebuilt, it is the same value."""
    import dataclasses
    from jax_cp._body import GivenQKV
    from jax_cp._projection import ChunkWeights, LinearProjections

    w = ChunkWeights(*(jnp.full((2, 2), i, jnp.float32) for i in range(4)))
    proj = LinearProjections(chunks=(w, w), norms=(None, None, None), o_bias=None, x=jnp.ones((1, 2, 2)),
                             pos=jnp.arange(2)[None], kv_x=(), kv_pos=jnp.arange(2)[None], spec="a spec",
                             dtype=jnp.float32, tie=False)
    for value, leaves in ((proj, 4 * 2 + 3), (GivenQKV(*(jnp.zeros(2),) * 3), 3)):
        assert dataclasses.is_dataclass(value) and type(value).__dataclass_params__.frozen
        flat, tree = jax.tree.flatten(value)
        assert len(flat) == leaves
        rebuilt = jax.tree.unflatten(tree, flat)
        assert type(rebuilt) is type(value)
        assert all(a is b for a, b in zip(jax.tree.leaves(rebuilt), flat))
    with pytest.raises(dataclasses.FrozenInstanceError):
        proj.x = None


def test_a_call_validates_its_spec_at_most_once(monkeypatch):
    """``"auto"`` is resolved in one step that does not validate the spec again: a layer call
    validates at most once (only when its own window/scale change the spec), a
    dot_product_attention call once."""
    from flax import nnx
    from jax_cp import _spec

    calls = []
    original = _spec.AttentionSpec.__post_init__
    monkeypatch.setattr(_spec.AttentionSpec, "__post_init__", lambda self: (calls.append(1), original(self)))
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    attn = jax_cp.CPAttention(8, 32, mesh=mesh, is_causal=True, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 16, 32), jnp.float32)
    for window, expected in ((None, 0), (4, 1)):
        calls.clear()
        jax.eval_shape(lambda x: attn(x, local_window_size=window), x)
        assert len(calls) == expected, (window, len(calls))
    calls.clear()
    q = jnp.ones((2, 16, 8, 4), jnp.float32)
    jax.eval_shape(lambda q: jax_cp.dot_product_attention(q, q, q, mesh=mesh, is_causal=True), q)
    assert len(calls) == 1


KERNEL_NAMES = set(jax_cp.kernels.KERNELS) - {"auto"}


def _string_constants(path: pathlib.Path):
    """Every string constant of ``path`` but the docstrings."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_kernel_names_live_only_in_the_kernel_folder():
    """Kernels are values: outside ``jax_cp/kernels/`` (which holds ``resolve``, the one place a name
    becomes a value) no code names a kernel by a string."""
    assert KERNEL_NAMES == {"blockwise", "xla", "splash", "cudnn", "pallas_gpu"}
    found = [f"{p.relative_to(REPO)}:{n.lineno}: {n.value!r}" for p in _files("jax_cp", "models")
             if ROOT / "kernels" not in p.parents for n in _string_constants(p) if n.value in KERNEL_NAMES]
    assert not found, found
