"""Kubernetes resource quantities ("500m", "4Gi", "1e3"), parsed the way the API server does.

The grammar is Kubernetes' own (k8s.io/apimachinery resource.Quantity):
a signed decimal number followed by a binary suffix (Ki Mi Gi Ti Pi Ei), a decimal
suffix (n u m "" k M G T P E) or a decimal exponent (e3, E-2). The value comes back
as a ``Decimal`` so comparisons (request ≤ limit) and Slurm conversions are exact.
"""

from __future__ import annotations

import re
from decimal import Decimal

from ddpk.errors import BadInput

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?"
)


def parse_quantity(text: str, flag: str) -> Decimal:
    """The value of a Kubernetes quantity; ``BadInput(flag, …)`` when it does not parse or is not positive."""
    if not isinstance(text, str):
        text = str(text)
    match = _QUANTITY.fullmatch(text.strip())
    if not match or text != text.strip():
        raise BadInput(flag, f"{text!r} is not a Kubernetes quantity (examples: 500m, 2, 4Gi, 512Mi)")
    number = Decimal(match["number"])
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        value = number * _BINARY[suffix]
    elif suffix in _DECIMAL:
        value = number.scaleb(_DECIMAL[suffix])
    else:
        value = number.scaleb(int(suffix[1:]))
    if value <= 0:
        raise BadInput(flag, f"{text!r} must be greater than zero")
    return value
