"""Every public name has a Google-style docstring: the API pages (docs/api/) are generated from them.

For each public module and each name in its ``__all__`` that is a function or a class: a docstring;
``Args:`` naming every parameter of a function or constructor (``*args``/``**kwargs`` aside);
``Attributes:`` (or ``Args:``) on a dataclass. Constants (``AUTO``, ``KERNELS``, ...) need none.
No compiles: this only imports jax_cp and reads ``__doc__``.
"""
import dataclasses
import importlib
import inspect
import re

import flax.linen as nn
import pytest

MODULES = ("jax_cp", "jax_cp.kernels", "jax_cp.exchanges", "jax_cp.linear", "jax_cp.linear.linen",
           "jax_cp.linear.reference", "jax_cp.load_balance", "jax_cp.linen", "jax_cp.plan", "jax_cp.reference")


SECTION = re.compile(r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Examples?|Notes?|References|"
                     r"Warnings?|See Also|Methods):\s*$")


def _public():
    for modname in MODULES:
        module = importlib.import_module(modname)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{modname}.{name}", obj


def _section(doc, title):
    """The lines of one section of a Google-style docstring (None when it has none)."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f"{title}:":
            body = []
            for rest in lines[i + 1:]:
                if SECTION.match(rest.strip()) and not rest.startswith((" ", "\t")):
                    break
                body.append(rest)
            return body
    return None


def _documented(body):
    """The names an Args:/Attributes: section documents (``a, b: ...`` documents both)."""
    entry = re.compile(r"^ {1,8}\**([A-Za-z_]\w*(?:, *\**[A-Za-z_]\w*)*)\s*(\(.*?\))?\s*:")
    return {name.strip(" *") for line in body for m in [entry.match(line)] if m for name in m.group(1).split(",")}


def _parameters(obj):
    target = obj
    if inspect.isclass(obj):
        if dataclasses.is_dataclass(obj):
            inherited = {"parent", "name"} if issubclass(obj, nn.Module) else set()  # flax.linen's own fields
            return [f.name for f in dataclasses.fields(obj)
                    if f.init and not f.name.startswith("_") and f.name not in inherited]
        try:
            target = obj.__init__ if "__init__" in vars(obj) else obj
            sig = inspect.signature(target)
        except (TypeError, ValueError):
            return []
    else:
        sig = inspect.signature(target)
    return [p.name for p in sig.parameters.values()
            if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


NAMES = sorted(dict(_public()).items())


def test_the_public_names_are_found():
    assert len(NAMES) > 60, len(NAMES)


@pytest.mark.parametrize("qualname,obj", NAMES, ids=lambda x: x if isinstance(x, str) else "")
def test_public_name_has_google_docstring(qualname, obj):
    doc = inspect.getdoc(obj) if obj.__doc__ else None
    assert doc and doc.strip(), f"{qualname} has no docstring"
    params = _parameters(obj)
    if dataclasses.is_dataclass(obj) and inspect.isclass(obj):
        body = _section(doc, "Attributes")
        body = body if body is not None else _section(doc, "Args")
        assert body is not None or not params, f"{qualname}: a dataclass needs an Attributes: section"
    else:
        body = _section(doc, "Args")
        assert body is not None or not params, f"{qualname}: needs an Args: section for {params}"
    missing = [p for p in params if p not in _documented(body or [])]
    assert not missing, f"{qualname}: parameters not in its Args:/Attributes: {missing}"
