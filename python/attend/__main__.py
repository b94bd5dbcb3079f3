"""python3 -m attend info: what the command-line tool's `attend info` prints (version, SIMD
targets compiled, supported and active, default threads, reduced-precision paths)."""

import argparse
import sys

from . import _attend


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m attend",
                                     description="attend's Python package")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="print the version, SIMD targets, thread count and the "
                                     "reduced-precision paths (as `attend info`)")
    parser.parse_args(argv)
    try:
        sys.stdout.write(_attend.runtime_report())
    except _attend.Error as error:  # a bad ATTEND_MAX_SIMD
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
