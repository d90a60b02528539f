"""Which of the fast paths' routes ran: for tests, and for a user who wants to see a lever act.

    from polopt_lightning.accel import trace

    with trace.routes() as ran:
        engine.generate(...)
    len(ran["prepacked_product"])   # one entry per call, each the route's detail (a shape, a row count)

Routes (each noted where it runs, only while a ``routes()`` block is open; otherwise one list check per call):

- ``onednn_product``: a product through oneDNN inside :class:`~.cpu.linear.OneDNNLinear` (detail: the weight's
  shape as passed, ``[out, in]`` or transposed for a backward product);
- ``kernel_product``: a float32 product on the few-row kernel (:func:`.cpu.rowdot.linear`; the weight's shape);
- ``four_bit_kernel``: a 4-bit product on the few-row kernel (the input's rows);
- ``four_bit_onednn``: a 4-bit product dequantized and multiplied through oneDNN (the input's rows);
- ``four_bit_input_grad``: a frozen 4-bit layer's input gradient through oneDNN (the weight's shape);
- ``prepack``: weights prepacked for decoding (detail: ``("mkl" | "onednn", [weight shapes])``);
- ``prepacked_product``: a product on prepacked weights (the input's shape);
- ``mode_dispatch``: a torch function seen by :class:`~.cpu.linear.OneDNNLinear`'s dispatch (the function);
- ``lean_step``: one lean decoding step (:mod:`.lean_step`); it is also a span: routes noted inside it carry it in
  their ``within``.

``ran.events`` holds every note in order as ``(route, detail, within)``, ``within`` the spans open at the time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

#: the open ``routes()`` records; callers on hot paths check ``if trace.OPEN:`` before calling :func:`note`
OPEN: list[Routes] = []
_within: list[str] = []


class Routes(dict):
    """route -> the details of its calls, in order; ``events`` all notes as ``(route, detail, within)``."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, Any, tuple[str, ...]]] = []

    def __missing__(self, route: str) -> list[Any]:
        return []  # a route that never ran reads as no calls (and is not added)


def note(route: str, detail: Any = None) -> None:
    """Record one call of ``route`` in every open :func:`routes` block."""
    within = tuple(_within)
    for ran in OPEN:
        ran.setdefault(route, []).append(detail)
        ran.events.append((route, detail, within))


_NOTHING = nullcontext()  # reusable: what span() gives while no block is open (hot paths create nothing)


def span(route: str) -> AbstractContextManager[None]:
    """Note ``route`` and mark the notes made inside the block as within it (nothing when no block is open)."""
    return _spanning(route) if OPEN else _NOTHING


@contextmanager
def _spanning(route: str) -> Iterator[None]:
    note(route)
    _within.append(route)
    try:
        yield
    finally:
        _within.pop()


@contextmanager
def routes() -> Iterator[Routes]:
    """A record of the routes that run inside the block (blocks may nest; each gets every note)."""
    ran = Routes()
    OPEN.append(ran)
    try:
        yield ran
    finally:
        OPEN.remove(ran)
