"""The checks of ``Checkpointer.save()``'s arguments (step, tag, persist, metadata depth,
metrics, the dtypes of the state's tensors), run on the training thread before anything is
planned or written. Each raises naming the argument or the key.

:func:`check_target` is the one check of which checkpoint a call names (step, tag, persist),
shared by ``save``, ``restore``, ``load`` and ``delete`` of every Checkpointer, with a memory tier
or without: it runs first, before any routing to a tier, and a bad value raises the same
ConfigError, ``"<call>(): <what was expected>, found <value>"``, whichever call got it."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError, SerializationError
from ..format import codec as fmt
from ..format.checks import MAX_METADATA_DEPTH
from ..providers.tree import Items


#: Largest step: the manifest holds a signed 64-bit step (docs/format.md), and a reader refuses
#: any other.
MAX_STEP = (1 << 63) - 1
#: Longest tag, in UTF-8 bytes: the checkpoint's temporary names add the writer's run id (which
#: holds the host name) to it, and must stay within the 255 bytes a file name may have.
MAX_TAG_BYTES = 128


def check_step(step, where: str = "") -> None:
    """``step`` is None or what a reader accepts: an int (not a bool) in [0, MAX_STEP]
    (``where``: the call, as a prefix of the message)."""
    if step is not None and (
        not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP
    ):
        raise ConfigError(f"{where}step must be an int in [0, 2**63 - 1], found {step!r}")


def check_tag(tag, where: str = "") -> str:
    """The name of a save's ``tag``: a valid checkpoint name (``format.check_name``) whose
    temporaries can exist, at most MAX_TAG_BYTES in UTF-8, without control characters (which
    readers accept in names already written); ConfigError otherwise (``where``: as for
    :func:`check_step`)."""
    try:
        name = fmt.check_name(tag)
    except ValueError as exc:
        raise ConfigError(f"{where}{exc}") from None
    control = next((c for c in name if c < " " or c == "\x7f"), None)
    if control is not None:  # an object store's batch DELETE (XML) cannot name them
        raise ConfigError(
            f"{where}invalid checkpoint name {name!r}: it holds the control "
            f"character {control!r}; expected printable characters only"
        )
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_TAG_BYTES:
        raise ConfigError(
            f"{where}invalid checkpoint name {name[:40] + '...'!r}: {size} bytes "
            f"in UTF-8, expected at most {MAX_TAG_BYTES} (its temporary names "
            "must fit the file system's 255-byte limit)"
        )
    return name


#: What ``check_target`` requires of step= and tag= together, by call.
_NAMED = {
    "save": "a step= or a tag= (or both)",
    "delete": "exactly one of step= or tag=",
    "restore": "at most one of step= or tag=",
    "load": "at most one of step= or tag=",
}


def check_target(call: str, step, tag, persist=None) -> str | None:
    """The checkpoint that ``call`` ("save", "restore", "load" or "delete") names: its name,
    or None for the latest (restore/load with neither step nor tag). ConfigError, before
    anything is routed, read or written, for

    - a step that is not None or an int (not a bool) in [0, 2**63 - 1];
    - a tag that is not None or a name ``save()`` writes (:func:`check_tag`: one path
      component, not reserved, printable, at most MAX_TAG_BYTES);
    - a ``persist`` (save) other than None, True or False: 0 and 1 are refused, not read as
      booleans (they would choose a tier by their truth);
    - save() without a step or a tag; delete() without exactly one of them; restore() and
      load() with both (a tag's step is not checked against a step: one names the checkpoint).

    The message is ``"<call>(): <expected>, found <value>"``, the same for every call."""
    where = f"{call}(): "
    check_step(step, where)
    name = check_tag(tag, where) if tag is not None else None
    if persist is not None and not isinstance(persist, bool):
        raise ConfigError(f"{where}persist must be None, True or False, found {persist!r}")
    need = _NAMED.get(call)
    if need is not None and (
        step is None
        and tag is None
        and call in ("save", "delete")
        or call != "save"
        and step is not None
        and tag is not None
    ):
        raise ConfigError(f"{where}{need} names the checkpoint, found step={step!r}, tag={tag!r}")
    if name is None and step is not None:
        name = fmt.step_name(step)
    return name


def check_view(state: Any, view: Any) -> None:
    """``save(view=...)``: None, or a top-level key of a dict ``state`` (a str); ConfigError
    otherwise, before anything is planned or written (docs/format.md, "The pickle")."""
    if view is None:
        return
    if not isinstance(view, str):
        raise ConfigError(
            f"save(): view must be None or a str naming a top-level key of the state, "
            f"found {type(view).__qualname__} {view!r}"
        )
    if not isinstance(state, dict):
        raise ConfigError(
            f"save(): view={view!r} expected a top-level key of the state, found a state of "
            f"type {type(state).__qualname__} (view needs a dict state)"
        )
    if view not in state:
        keys = [k for k in state if isinstance(k, str)]
        shown = ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
        raise ConfigError(
            f"save(): view={view!r} expected a top-level key of the state, found the keys [{shown}]"
        )


def check_depth(metadata: dict) -> None:
    """ConfigError when ``metadata`` nests dicts and lists deeper than MAX_METADATA_DEPTH."""
    level, depth = [metadata], 1
    while level:
        if depth > MAX_METADATA_DEPTH:
            raise ConfigError(
                f"metadata nests deeper than {MAX_METADATA_DEPTH} levels; a "
                "reader could not decode it"
            )
        below: dict[int, Any] = {}  # each container once per level, even if it holds itself
        for value in level:
            for child in value.values() if isinstance(value, dict) else value:
                if isinstance(child, (dict, list, tuple)):
                    below[id(child)] = child
        level, depth = list(below.values()), depth + 1


def check_metrics(metrics: Any) -> dict:
    """``save(metrics=...)`` as the manifest records it: a dict of str → finite int or float
    (subclasses such as ``numpy.float64`` become plain int and float); TypeError or ValueError
    naming the key otherwise."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError(
            f"metrics must be a dict of name -> number, found {type(metrics).__qualname__}"
        )
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(
                f"metrics: expected str names, found the key {key!r} ({type(key).__qualname__})"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"metrics[{key!r}]: expected an int or float, found "
                f"{type(value).__qualname__} {value!r} (convert with float())"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"metrics[{key!r}]: expected a finite number, found {value!r}")
        out[key] = int(value) if isinstance(value, int) else float(value)
    return out


def check_dtypes(items: Items) -> None:
    """Fail inside save(), not after the I/O, on a tensor the format cannot hold."""
    supported = fmt.SUPPORTED_DTYPES
    for key, dtype in zip(items.keys, items.dtypes):
        if dtype is not None and dtype not in supported:
            try:
                fmt.dtype_name(dtype)
            except TypeError as exc:
                raise SerializationError(
                    f"{key!r}: {exc}; convert it first (for example with .to(torch.float32))"
                ) from None
