"""The gateway's command line (its serving is tested end to end, in test_node_faults)."""

from __future__ import annotations

import pytest
from promptlb.middleware._gateway import _parser


@pytest.mark.parametrize("given", ["INFO", "info", "Info"])
def test_the_log_level_is_taken_in_either_case(given: str) -> None:
    # One LOG_LEVEL shared by a pod's containers: the sidecar took only upper case, the
    # gateway only lower, and one of them crash-looped.
    args = _parser().parse_args(["--config", "x.toml", "--log-level", given])
    assert args.log_level == "info"


def test_the_help_tells_where_it_listens_by_default() -> None:
    text = _parser().format_help()
    assert "(default: 127.0.0.1)" in text and "(default: 8080)" in text
    assert "(default: None)" not in text
