"""The ``prefix-cache`` command line.

Commands implemented in this pure layer (benchmarks, trace replay) are listed
here; commands that need Ray (the demo, the server, the transfer benchmark)
live in higher layers and register through the ``prefix_cache.commands`` entry
point group, so this module never imports them by name.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import entry_points

from cluster.errors import CacheError

# command words -> module exposing add_arguments(parser), run(args) -> int, and a docstring.
BUILTIN = {
    ("bench", "radix"): "cluster.bench.radix",
    ("bench", "fragmentation"): "cluster.bench.fragmentation",
    ("bench", "tiers"): "cluster.bench.tiers",
    ("bench", "multiturn"): "cluster.bench.multiturn",
    ("bench", "engine"): "cluster.bench.engine",
    ("bench", "chat"): "cluster.bench.chat",
    ("bench", "exactness"): "cluster.bench.exactness",
    ("replay",): "cluster.bench.replay",
}
ENTRY_POINT_GROUP = "prefix_cache.commands"


def _registered() -> dict[tuple[str, ...], str]:
    commands = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        commands[tuple(ep.name.split("."))] = ep.value
    return commands


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="prefix-cache", description="Tiered radix prefix cache cluster")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    handlers = {}
    for words, module_name in sorted(_registered().items()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a layer whose third-party package is not installed
            if exc.name and exc.name.split(".")[0] not in ("cluster", "actors", "serve_app", "lab"):
                continue
            raise
        doc = (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
        if len(words) == 1:
            sub = top.add_parser(words[0], help=doc, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        else:
            if words[0] not in groups:
                gp = top.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = gp.add_subparsers(dest="subcommand", metavar="NAME", required=True)
            sub = groups[words[0]].add_parser(words[1], help=doc, description=module.__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.add_argument("--results", default=None, metavar="FILE",
                         help="also append the JSON lines this command prints to FILE")
        sub.set_defaults(_handler=module.run)
        handlers[words] = module
    return parser, handlers


def main(argv: list[str] | None = None) -> int:
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    from cluster.bench import common

    common.RESULTS_FILE = args.results
    try:
        return int(args._handler(args) or 0)
    except (CacheError, ValueError) as exc:
        parser.exit(2, f"prefix-cache: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
