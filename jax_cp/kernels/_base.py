"""The kernel as a value: what each local attention kernel says about itself, and the one place a
kernel's name becomes its value (``resolve``).

A kernel is a frozen value of a ``Kernel`` subclass, one per file in this folder, registered by
name. It says which calls it cannot serve and why (``unsupported_reason``), attends (``attend``),
and, for the ring, whether it returns the log-sum-exp a ring step merges (``merges_lse``) or which
kernel a ring step runs in its place (``ring_step``).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jax_cp._checks import check_scale

__all__ = ["AUTO", "Kernel", "REGISTRY", "register", "resolve", "scaled_query"]

AUTO = "auto"  # not a kernel: the selection's rule picks one per call
REGISTRY: dict[str, "Kernel"] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class Kernel:
    """Base of the kernel values. Equal to (and hashing as) its name, so a value and the string a user
    passed compare alike; ``repr`` is the quoted name, as error messages print it."""

    name: ClassVar[str]
    label: ClassVar[str] = ""  # how a message names it, when not by ``name``
    merges_lse: ClassVar[bool] = False  # returns each row's log-sum-exp: a ring step can merge it
    fused: ClassVar[tuple | None] = None  # (forward, backward): blockwise's algorithm as this kernel's code
    takes_spans: ClassVar[bool] = False  # bidirectional span ids (span_ids) among its mask inputs

    def unsupported_reason(self, **needs) -> str | None:
        """Why this kernel cannot serve a call with these ``needs`` (``None`` when it can)."""
        return None

    def why_not(self, *, spans: bool = False, **needs) -> str | None:
        """``unsupported_reason``, and span ids (``spans``) for a kernel that does not take them."""
        if spans and not self.takes_spans:
            return f"span ids (span_ids) are not among the {self.label or self.name} kernel's mask inputs"
        return self.unsupported_reason(**needs, **({"spans": True} if spans else {}))

    def check(self, *, platform: str, **needs) -> None:
        """``ValueError`` when an explicit choice of this kernel cannot serve the call."""
        why = self.why_not(**needs)
        if why:
            raise ValueError(f"kernel={self!r} cannot serve this call: {why}; use kernel='blockwise' or 'auto'.")

    def ring_step(self) -> "Kernel":
        """The kernel a ring step runs when this one was chosen (itself, if it merges log-sum-exps)."""
        return self

    def attend(self, q_BTHd, k_BSKd, v_BSKd, **kw):
        """``local_attention``'s contract on one device's share."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return repr(self.name)

    def __eq__(self, other) -> bool:
        return isinstance(other, (Kernel, str)) and str(other) == self.name

    def __hash__(self) -> int:
        return hash(self.name)


def register(cls):
    """Class decorator: one value of ``cls`` joins the kernels the public strings name."""
    REGISTRY[cls.name] = cls()
    return cls


def resolve(kernel):
    """The one place a kernel's name becomes its value: ``"auto"`` and values pass as they are.

    Args:
        kernel: ``"auto"``, a kernel name or a :class:`Kernel` value.

    Returns:
        The :class:`Kernel` value (or ``"auto"``).

    Raises:
        ValueError: ``kernel`` names no registered kernel.
    """
    if isinstance(kernel, Kernel) or kernel == AUTO:
        return kernel
    if isinstance(kernel, str) and kernel in REGISTRY:
        return REGISTRY[kernel]
    raise ValueError(f"kernel={kernel!r} is not one of {(AUTO, *REGISTRY)}.")


def scaled_query(q, scale):
    """The query and a scale the kernels take as a Python float (they fix it when traced).

    A number (Python or NumPy) or a concrete scalar array becomes a float; a traced scalar (under
    ``jit``, ``grad``, ``vmap``) is multiplied into ``q`` instead, in float32 (float64 for float64
    inputs) and rounded once to ``q``'s dtype, with ``1.0`` as the kernels' scale: the logits are
    the same, every kernel serves it, and its gradient flows to the scale.

    Args:
        q: the queries ``[..., d]``.
        scale: ``None`` (the kernels' ``d ** -0.5``), a real number or a real scalar array.

    Returns:
        ``(q, scale)``: ``q`` (scaled when ``scale`` was traced) and ``None`` or a Python float.

    Raises:
        ValueError: ``scale`` is not a real scalar.
    """
    scale = check_scale(scale, allow_traced=True)
    if scale is None or isinstance(scale, float):
        return q, scale
    acc = jnp.promote_types(q.dtype, jnp.float32)
    return (q.astype(acc) * scale.astype(acc)).astype(q.dtype), 1.0
