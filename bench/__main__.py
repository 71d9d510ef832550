"""`python -m bench NAME [args]`: run one benchmark; without a name, list them."""

from __future__ import annotations

import importlib
import sys

from bench import names, purpose


def usage() -> str:
    width = max(map(len, names()))
    lines = ["usage: python -m bench NAME [args]   (NAME --help: its options)", ""]
    lines += [f"  {name:<{width}}  {purpose(name)}" for name in names()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names():
        print(f"no benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from specmlx.errors import SpecmlxError

    module = importlib.import_module(f"bench.{name}")
    sys.argv = [f"python -m bench {name}", *rest]  # what argparse shows and results record
    try:
        return module.main(rest) or 0
    except SpecmlxError as e:  # a problem the benchmark explains in one line
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
