"""``promptlb-bench``: the command line only parses and forwards to the runners."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from promptlb.shared import ConfigError, parse_duration

__all__ = ["main"]

DEFAULT_STRATEGIES = "round_robin,least_conn,p2c,predictive,model_aware"


# What says where a run writes, or what it replays, rather than how it is run: changing these
# still makes a run the committed files' like.
_NOT_SETTINGS = frozenset({"command", "scenario", "out", "no_plot", "url"})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="promptlb-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    cluster = sub.add_parser("cluster", help="replay a scenario against a live emulated cluster")
    cluster.add_argument("scenario", help="a name in bench/scenarios/ or a TOML path")
    cluster.add_argument(
        "--strategies", default=DEFAULT_STRATEGIES, help="comma-separated promptlb strategies"
    )
    cluster.add_argument(
        "--peers",
        default="nginx,litellm",
        help="comma-separated peers to run too (nginx, litellm, oracle), or none; scenarios "
        "with prompts always run the oracle",
    )
    cluster.add_argument("--duration", default=None, help="override the scenario's duration")
    cluster.add_argument(
        "--replicas", type=int, default=8, help="gateways of a +shared run (sharing one Redis)"
    )
    cluster.add_argument(
        "--out",
        default=None,
        help="results folder (default bench/results; bench/results/quick for a run with any "
        "other option changed)",
    )
    cluster.add_argument("--no-plot", action="store_true", help="skip the PNG")

    sim = sub.add_parser("sim", help="discrete-event simulation with a virtual clock")
    sim.add_argument("scenario", help="a name in bench/scenarios/ or a TOML path")
    sim.add_argument("--strategies", default=DEFAULT_STRATEGIES + ",resource,weighted")
    sim.add_argument("--replicas", type=int, default=8, help="middleware replicas")
    sim.add_argument("--staleness", default="1s", help="snapshot age the replicas see")
    sim.add_argument(
        "--nodes", type=int, default=None, help="scale the scenario's node list to this many nodes"
    )
    sim.add_argument("--duration", default=None, help="override the scenario's duration")
    sim.add_argument(
        "--out",
        default=None,
        help="results folder (default bench/results; bench/results/quick for a run with any "
        "other option changed)",
    )
    sim.add_argument("--no-plot", action="store_true", help="skip the PNG (prompt scenarios)")

    faults = sub.add_parser("faults", help="one fault after another under steady load")
    faults.add_argument("--quick", action="store_true", help="hold each fault a few seconds")
    faults.add_argument(
        "--out",
        default=None,
        help="results folder (default bench/results; bench/results/quick for --quick or --only)",
    )
    faults.add_argument(
        "--only",
        default=None,
        help="comma-separated parts of fault names to run, e.g. 'leak' or 'kill a node,streams' "
        "(the closing soak is 'streams'); such a run writes under bench/results/quick/",
    )

    endpoint = sub.add_parser("endpoint", help="capacity planning against any OpenAI endpoint")
    endpoint.add_argument("url", help="base URL, e.g. http://127.0.0.1:8000")
    endpoint.add_argument("--model", required=True)
    endpoint.add_argument("--concurrency", default="1,2,4,8,16,32")
    endpoint.add_argument("--seconds", type=float, default=10.0, help="per concurrency level")
    endpoint.add_argument("--max-tokens", type=int, default=64)
    endpoint.add_argument(
        "--target-rate",
        type=float,
        default=None,
        help="requests/s to plan for (with 20%% headroom)",
    )
    endpoint.add_argument("--out", default=None, help="results folder (default bench/results)")
    for sub_parser in (cluster, sim):
        sub_parser.set_defaults(changed=partial(_changed, sub_parser))
    return parser


def _changed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The options of ``args`` set to other than their defaults, among those that change what
    a run measures. Compared as read: a list of names in another order, or ``--duration`` the
    scenario's own length, is the run as committed (which the run itself takes it for), and
    sent the full run's results under quick/."""
    return [
        name
        for name, value in vars(args).items()
        if name not in _NOT_SETTINGS
        and name != "changed"
        and not _same(name, value, parser.get_default(name), args)
    ]


def _same(name: str, value: object, default: object, args: argparse.Namespace) -> bool:
    if value == default:
        return True
    if not isinstance(value, str):
        return False
    if name in ("strategies", "peers") and isinstance(default, str):
        return _names(value) == _names(default)
    try:
        if name == "staleness" and isinstance(default, str):
            return parse_duration(name, value) == parse_duration(name, default)
        if name == "duration" and default is None:
            from ._scenario import load_scenario

            return parse_duration(name, value) == load_scenario(args.scenario).duration
    except (ConfigError, OSError):
        return False  # refused where the run reads it, with the reason
    return False


def _names(listed: str) -> frozenset[str]:
    return frozenset(n.strip() for n in listed.split(",") if n.strip())


def _results_folder(args: argparse.Namespace) -> None:
    """A run unlike the committed ones (fewer strategies, no peers, a shorter duration...)
    writes under ``bench/results/quick/`` unless ``--out`` says where: it must never replace
    the committed full runs' files by the same names."""
    if args.out is not None:
        return
    changed = args.changed(args)
    if changed:
        from ._report import RESULTS

        args.out = str(RESULTS / "quick")
        options = ", ".join("--" + name.replace("_", "-") for name in changed)
        print(
            f"promptlb-bench: {options} set, so this run writes under {args.out} (--out to choose)",
            file=sys.stderr,
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command in ("cluster", "sim"):
            _results_folder(args)
        if args.command == "cluster":
            from ._live import run_cluster

            run_cluster(args)
        elif args.command == "faults":
            from ._faultsuite import run_faults

            only = [p.strip() for p in args.only.split(",") if p.strip()] if args.only else None
            report = run_faults(args.quick, Path(args.out) if args.out else None, only)
            for row in report["faults"]:
                print(
                    f"{row['fault']:<36} sent {row['sent']:>5}  failed {row['failed']:>3}  "
                    f"cut streams {row['broken_streams']:>3}  detect {row.get('detect_s')}  "
                    f"recover {row.get('recover_s')}"
                    + (f"  states {' > '.join(row['states'])}" if row.get("states") else "")
                )
            print(f"gateway RSS growth: {100 * report['gateway_rss_growth']:.1f}%")
            if report.get("soak_held_growth") is not None:
                held = report["soak_held_rss_mb"]
                print(
                    f"while every stream was open: {held[0]} -> {held[1]} MB"
                    f" ({100 * report['soak_held_growth']:.1f}%)"
                )
        elif args.command == "sim":
            from ._sim import run_sim

            run_sim(args)
        else:
            from ._endpoint import run_endpoint

            run_endpoint(args)
    except ConfigError as exc:
        print(f"promptlb-bench: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
