"""Moved to :mod:`hecate.passes.report` (the report sits below the passes); kept so existing imports work."""

from hecate.passes.report import Fusion, FusionReport, Miss, source_line  # noqa: F401
