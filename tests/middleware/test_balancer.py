"""The balancer's header filter, as a unit: what a node is sent of the client's headers."""

from __future__ import annotations

from promptlb.middleware import Config, NodeConfig
from promptlb.middleware._balancer import _NAMES_KEPT, Balancer


def test_the_filter_remembers_only_so_many_header_names_and_filters_alike_past_them() -> None:
    lb = Balancer(Config(nodes=(NodeConfig(name="a", url="http://127.0.0.1:1"),)))
    node = lb.table.nodes["a"]
    made_up = [(f"x-made-up-{i}".encode(), b"v") for i in range(3 * _NAMES_KEPT)]
    client = [
        (b"content-type", b"application/json"),
        (b"Cookie", b"session=secret"),
        (b"x-promptlb-priority-token", b"secret"),
        (b"connection", b"keep-alive, X-Hop"),
        (b"x-hop", b"1"),
    ]
    for _ in range(2):  # the second time from what it remembered
        sent = dict(lb.forward_headers(node, made_up + client))
        assert len(lb._names) <= _NAMES_KEPT
        assert b"content-type" in lb._names  # made-up names did not keep it out for good
        assert sent["content-type"] == "application/json"
        assert sent[f"x-made-up-{3 * _NAMES_KEPT - 1}"] == "v"
        assert not {"cookie", "x-promptlb-priority-token", "connection", "x-hop"} & set(sent)
