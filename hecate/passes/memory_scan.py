"""A per-token l_p memory loop (or a ``scan``) → ONE ``hecate.memory_scan``.

A Python loop ``for t in range(T): M, y_t = step(M, k[:, t], ...)`` reaches the passes as
``torch.ops.higher_order.scan``: :mod:`hecate.compiler.loops` proves Dynamo's unrolled
copies are one loop and rolls them up (a user's own ``scan`` arrives as is). This pass
asks :mod:`hecate.passes.memory_step` whether the scan's body is the l_p memory step of
``spec/lp-attentional-bias.md`` — ``e = read(M, k) − v``, ``M ← (1 − α) M − η g(e) kᵀ``
(plain GD, momentum, MONETA L_q retention), ``y = read(M, q)`` — by what it computes, in
any spelling, and replaces the scan by one ``memory_scan(k, v, q, alpha, eta, m0, None, p,
a, eps, momentum, q_norm)``. A scan whose body is no memory step is reported with the
first reason, in the user's terms, and left as it is.
"""

from __future__ import annotations

from torch import fx

from hecate.passes.report import FusionReport
from hecate.passes.memory_step import fuse_scans, report_unrolled_updates


def run(gm: fx.GraphModule, report: FusionReport) -> None:
    """Replace every scan whose body is an l_p memory step by one hecate.memory_scan; report unrolled updates."""
    fuse_scans(gm, report, "memory_scan")
    report_unrolled_updates(gm, report)
