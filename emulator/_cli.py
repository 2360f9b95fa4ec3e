"""``promptlb-emulator``: the command line only forwards to `EmulatorConfig`."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from promptlb.shared._serve import config_or_exit, serve

from ._app import STATE, create_app
from ._config import EmulatorConfig

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="promptlb-emulator",
        description="An emulated OpenAI-compatible model server with a capacity model and faults.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = EmulatorConfig()
    p.add_argument(
        "--model", action="append", help=f"served model name (repeatable); default {d.models[0]!r}"
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    cap = p.add_argument_group("capacity")
    cap.add_argument("--slots", type=int, default=d.slots, help="concurrent generations")
    cap.add_argument("--tokens-per-s", type=float, default=d.tokens_per_s, help="per slot")
    cap.add_argument("--ttft-ms", type=float, default=d.ttft_ms)
    cap.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=d.prefill_tokens_per_s,
        help="prompt tokens not found in the KV cache add to TTFT at this rate; 0 disables",
    )
    cap.add_argument(
        "--output-tokens",
        type=int,
        default=d.output_tokens,
        help="output length when the request gives no max_tokens (the mean)",
    )
    cap.add_argument(
        "--output-spread",
        type=float,
        default=d.output_spread,
        help="log-normal sigma of the output length, 0..10; 0 is fixed",
    )
    cap.add_argument("--max-queue", type=int, default=d.max_queue, help="beyond it: 429")
    cap.add_argument(
        "--kv-blocks",
        type=int,
        default=d.kv_blocks,
        help="KV-cache capacity in blocks of 16 tokens (LRU prefix cache); 0 means slots x 128",
    )
    cap.add_argument("--embedding-dim", type=int, default=d.embedding_dim)
    cap.add_argument(
        "--load-time-s",
        type=float,
        default=d.load_time_s,
        help="answer 503 for this long after start, like a model loading",
    )
    cap.add_argument(
        "--stream-interval-ms",
        type=float,
        default=d.stream_interval_ms,
        help="one SSE event per interval, carrying the tokens due by then",
    )
    faults = p.add_argument_group("faults")
    faults.add_argument(
        "--error-rate", type=float, default=d.error_rate, help="share of requests answered 500"
    )
    faults.add_argument(
        "--slow-factor",
        type=float,
        default=d.slow_factor,
        help="multiplies TTFT and divides tokens/s",
    )
    faults.add_argument(
        "--hang-after",
        type=int,
        default=d.hang_after,
        help="requests after the first N never answer; 0 disables",
    )
    faults.add_argument(
        "--crash-after",
        type=int,
        default=d.crash_after,
        help="the process exits on request N+1; 0 disables",
    )
    faults.add_argument(
        "--leak-mb-per-req",
        type=float,
        default=d.leak_mb_per_req,
        help="memory held for good by every request",
    )
    faults.add_argument(
        "--poison",
        default="",
        help="a request whose body holds this text is answered 500 (a request that breaks "
        "every node alike); empty: off",
    )
    p.add_argument("--seed", type=int, default=None, help="makes faults and lengths repeatable")
    p.add_argument(  # either case, as the sidecar's and the gateway's
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    models = tuple(m for raw in (args.model or ["emulated"]) for m in raw.split(",") if m)

    def build() -> EmulatorConfig:
        return EmulatorConfig(
            models=models,
            host=args.host,
            port=args.port,
            slots=args.slots,
            tokens_per_s=args.tokens_per_s,
            ttft_ms=args.ttft_ms,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            output_tokens=args.output_tokens,
            output_spread=args.output_spread,
            max_queue=args.max_queue,
            kv_blocks=args.kv_blocks,
            embedding_dim=args.embedding_dim,
            load_time_s=args.load_time_s,
            stream_interval_ms=args.stream_interval_ms,
            error_rate=args.error_rate,
            slow_factor=args.slow_factor,
            hang_after=args.hang_after,
            crash_after=args.crash_after,
            leak_mb_per_req=args.leak_mb_per_req,
            seed=args.seed,
        )

    config = config_or_exit(parser, build)
    app = create_app(config)
    faults = app[STATE].faults
    faults.poison = args.poison
    serve(app, config.host, config.port, "promptlb-emulator")
