"""The ``hecate`` command.

    hecate list                     the example models
    hecate explain NAME [NAME ...]  the fusion report of each example model
    hecate explain all
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from hecate.models import EXAMPLES

    parser = argparse.ArgumentParser(prog="hecate", description="Inspect what Hecate fuses.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the example models")
    ex = sub.add_parser("explain", help="print the fusion report of example models")
    ex.add_argument("names", nargs="+", metavar="NAME", help=f"one of {sorted(EXAMPLES)} or 'all'")
    ex.add_argument("--fallback", choices=["inductor", "eager"], default="inductor")
    args = parser.parse_args(argv)

    if args.command == "list":
        for name in sorted(EXAMPLES):
            print(name)
        return 0

    names = sorted(EXAMPLES) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        print(f"hecate: unknown example(s) {unknown}; choose from {sorted(EXAMPLES)} or 'all'", file=sys.stderr)
        return 2

    import hecate

    for name in names:
        model, example_args = EXAMPLES[name]()
        print(f"== {name} ==")
        print(hecate.explain(model, *example_args, options={"fallback": args.fallback}))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
