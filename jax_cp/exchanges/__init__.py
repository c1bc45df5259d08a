"""How K/V cross ``cp_colossal``: one frozen value per exchange, one file each.

=============  ==================================  ===============================================
value          collective (file)                   when
=============  ==================================  ===============================================
``AllGather``  all-gather along the sequence       default; O(S) K/V per device
               (``all_gather.py``)
``AllToAll``   one all-to-all over both CP axes    async on every TPU generation; no fused Q/K/V
               (``all_to_all.py``)
``Ring``       ``ppermute`` around the ring        O(S/c) memory; splash or blockwise per step
               (``ring.py``)
``Attended``   ``ppermute`` of the key blocks      packed rows on a dispatch plan's order
               each rank's queries may see         (``load_balance.plan(...).kv_exchange``);
               (``attended.py``)                   not a public string: its sizes are the batch's
=============  ==================================  ===============================================

Each value holds its collective (with its ``jax.custom_vjp`` backward), the
per-device ``attend`` step that uses it and its constraints (``check_kernel``,
``fuses_qkv``, ``ties_chunks``). The public strings (``kv_exchange="ring"``)
become values in :func:`resolve` and nowhere else. A new exchange is one file
here (a ``KVExchange`` subclass decorated with ``@register``) and its name on
the import line below.
"""
from jax_cp.exchanges import all_gather, all_to_all, ring  # noqa: F401  (each registers its exchange)
from jax_cp.exchanges._base import REGISTRY, KVExchange, Meta
from jax_cp.exchanges.all_gather import AllGather
from jax_cp.exchanges.attended import Attended
from jax_cp.exchanges.all_to_all import AllToAll
from jax_cp.exchanges.ring import Ring

__all__ = ["AllGather", "AllToAll", "Attended", "DEFAULT", "EXCHANGES", "KVExchange", "Meta", "NAMES", "Ring", "resolve"]

EXCHANGES: tuple[KVExchange, ...] = tuple(REGISTRY)
NAMES: tuple[str, ...] = tuple(x.name for x in EXCHANGES)
DEFAULT: KVExchange = EXCHANGES[0]


def resolve(kv_exchange) -> KVExchange:
    """An exchange value, or its name, as the value (the one place strings become exchanges).

    Args:
        kv_exchange: a :class:`KVExchange` value, or the name of one of :data:`EXCHANGES`.

    Returns:
        The :class:`KVExchange`.

    Raises:
        ValueError: ``kv_exchange`` names no exchange.
    """
    if isinstance(kv_exchange, KVExchange):
        return kv_exchange
    for x in EXCHANGES:
        if x.name == kv_exchange:
            return x
    raise ValueError(f"kv_exchange={kv_exchange!r} must be one of {NAMES} (or a jax_cp.exchanges value).")
