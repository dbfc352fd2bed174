"""Dynamic batch and sequence: the dims ``stackfuse import --dynamic`` makes symbolic.

One home for their names, where they sit and how their bounds are read back. By the Hugging Face
convention every user input is ``[batch, seq, ...]``: ``batch`` is axis 0 of each tensor input,
``seq`` axis 1 of each input of rank 2 or more. Their upper bounds travel in ``main``'s
``tir_var_upper_bound`` attribute (TVM's memory planning sizes buffers from it) and are read back
from there for the manifest and the report; everything else (hidden size, heads, weights) stays
static.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.errors import InputError

#: the dims that can be made symbolic -> the input axis each one is
AXES: dict[str, int] = {"batch": 0, "seq": 1}
#: TVM's function attribute for symbolic upper bounds (read by its memory planning)
UPPER_BOUND_ATTR = "tir_var_upper_bound"


def parse(text: str) -> dict[str, int]:
    """``"batch:8,seq:1024"`` -> ``{"batch": 8, "seq": 1024}`` (either or both)."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, bound = part.partition(":")
        if not sep:
            raise InputError(f"--dynamic {part!r}: expected NAME:MAX, e.g. batch:8,seq:1024")
        try:
            out[name.strip()] = int(bound)
        except ValueError:
            raise InputError(f"--dynamic {part!r}: the bound must be an integer") from None
    return checked(out)


def checked(dynamic: Mapping[str, int]) -> dict[str, int]:
    """The bounds, refused unless each name is one of :data:`AXES` and each bound is >= 2
    (torch.export specializes a dim that can be 0 or 1 only)."""
    out: dict[str, int] = {}
    for name, bound in dynamic.items():
        if name not in AXES:
            raise InputError(
                f"dynamic dim {name!r} is not one of {', '.join(AXES)} "
                "(batch is axis 0 of every input, seq axis 1)"
            )
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 2:
            raise InputError(f"dynamic dim {name!r}: the upper bound must be an integer >= 2")
        out[name] = bound
    if not out:
        raise InputError("dynamic: name at least one of batch, seq")
    return out


def axes_of(ndim: int, dynamic: Mapping[str, int]) -> dict[int, str]:
    """Which axes of an input of rank ``ndim`` are symbolic, and as which dim."""
    return {AXES[n]: n for n in dynamic if AXES[n] < ndim}


def bounds_of(func: Any) -> dict[str, int]:
    """``func``'s symbolic upper bounds, by dim name (empty for a static function)."""
    attrs = func.attrs
    raw = attrs.get(UPPER_BOUND_ATTR) if attrs is not None else None
    if raw is None:
        return {}
    return {str(k): int(v) for k, v in raw.items()}


def describe(func: Any) -> list[dict[str, Any]]:
    """Each symbolic dim of ``func``'s user inputs: ``{"name", "upper_bound", "inputs"}``, where
    ``inputs`` lists ``"input[axis]"`` for every place it appears (empty for a static module).

    The manifest and the report both carry this list; it is read from the module itself, so a
    module written by hand with symbolic dims is described the same way."""
    attrs = func.attrs
    params = list(func.params)
    num_input = (
        int(attrs["num_input"]) if attrs is not None and "num_input" in attrs else len(params)
    )
    bounds = bounds_of(func)
    found: dict[str, list[str]] = {}
    for p in params[:num_input]:
        values = getattr(getattr(p.ty, "shape", None), "values", None) or []
        for axis, d in enumerate(values):
            if hasattr(d, "name") and not hasattr(d, "value"):  # a tirx.Var, not an IntImm
                found.setdefault(str(d.name), []).append(f"{p.name}[{axis}]")
    return [
        {"name": name, "upper_bound": bounds.get(name), "inputs": where}
        for name, where in found.items()
    ]
