"""The options a user passes as ``torch.compile(..., backend="hecate", options={...})``.

Every key and value is checked; a mistake raises :class:`HecateOptionsError`
naming what was received and what is valid, rather than being ignored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

FALLBACKS = ("inductor", "eager")


class HecateOptionsError(ValueError):
    """An option passed to the hecate backend is unknown or has a bad value."""


@dataclass(frozen=True)
class Options:
    """Validated backend options.

    patterns:     the pattern names to fuse (default: every registered pattern).
    fallback:     what compiles the rest of the graph: "inductor" (default) or "eager".
    dump_dir:     a folder; when set, the graph before and after each pass is written
                  there as readable text (one file per graph and pass).
    print_report: print the fusion report of each compiled graph to stdout.
    strict:       re-raise an error inside a pass or the pipeline instead of leaving the graph
                  as Dynamo gave it and reporting "internal error in pass X" (default False;
                  the environment variable HECATE_STRICT=1 makes it default True, as the
                  test suite does).
    progress:     print each compile stage (rolling loops, re-trace, each pass, the fallback
                  compile) and its time to stderr as it runs, for long first compiles.
                  ``TORCH_LOGS="hecate"`` logs the same timings and every pass decision.
    """

    patterns: tuple[str, ...]
    fallback: str = "inductor"
    dump_dir: str | None = None
    print_report: bool = False
    strict: bool = field(default_factory=lambda: strict_by_default())  # read when created, not at import
    progress: bool = False


def strict_by_default() -> bool:
    """Whether HECATE_STRICT asks errors inside Hecate to be raised (``1``) or contained (unset, ``0``)."""
    value = os.environ.get("HECATE_STRICT", "0")
    if value not in ("0", "1"):
        raise HecateOptionsError(f"environment variable HECATE_STRICT must be 0 or 1, got {value!r}")
    return value == "1"


def parse_options(options: Mapping[str, Any] | None) -> Options:
    """Validate ``options`` (a dict or None) and return :class:`Options`."""
    from hecate.passes import PASSES  # the registered pattern names

    if options is None:
        options = {}
    if isinstance(options, Options):
        return options
    if not isinstance(options, Mapping):
        raise HecateOptionsError(
            f"options must be a dict, got {type(options).__name__}: {options!r}")
    valid = [f.name for f in fields(Options)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise HecateOptionsError(
            f"unknown hecate option(s) {unknown}; valid options are {valid}")

    patterns = options.get("patterns", "all")
    if patterns == "all":
        patterns = tuple(PASSES)
    elif isinstance(patterns, str) or not isinstance(patterns, (list, tuple, set, frozenset)) \
            or not all(isinstance(p, str) for p in patterns):
        raise HecateOptionsError(
            f"option 'patterns' must be \"all\" or a list of pattern names, got {patterns!r}; "
            f"valid names are {list(PASSES)}")
    else:
        bad = [p for p in patterns if p not in PASSES]
        if bad:
            raise HecateOptionsError(
                f"option 'patterns' has unknown pattern(s) {bad}; valid names are {list(PASSES)}")
        patterns = tuple(patterns)

    fallback = options.get("fallback", "inductor")
    if fallback not in FALLBACKS:
        raise HecateOptionsError(
            f"option 'fallback' must be one of {list(FALLBACKS)}, got {fallback!r}")

    dump_dir = options.get("dump_dir")
    if dump_dir is not None:
        if not isinstance(dump_dir, (str, os.PathLike)):
            raise HecateOptionsError(
                f"option 'dump_dir' must be a folder path (str), got {type(dump_dir).__name__}: {dump_dir!r}")
        dump_dir = os.fspath(dump_dir)
        if os.path.exists(dump_dir) and not os.path.isdir(dump_dir):
            raise HecateOptionsError(f"option 'dump_dir' {dump_dir!r} exists and is not a folder")

    flags = {name: options.get(name, default) for name, default in
             (("print_report", False), ("strict", strict_by_default()), ("progress", False))}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise HecateOptionsError(f"option {name!r} must be True or False, got {value!r}")

    return Options(patterns=patterns, fallback=fallback, dump_dir=dump_dir, **flags)
