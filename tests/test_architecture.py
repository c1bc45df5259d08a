"""The layout a newcomer relies on, checked: exchanges as values, one spec, short functions.

Exchange names appear as strings only in ``jax_cp/exchanges/`` (which also holds
the one place that converts them); the grouped-query message exists once; the
per-shard body stays a readable page.
"""
import ast
import pathlib

import jax_cp

ROOT = pathlib.Path(jax_cp.__file__).parent
REPO = ROOT.parent
NAMES = set(jax_cp.exchanges.NAMES)


def _files(*dirs):
    for d in dirs:
        yield from sorted((REPO / d).rglob("*.py"))


def _functions(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


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
    assert [p.relative_to(REPO).as_posix() for p in hits] == ["jax_cp/_spec.py"]


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
