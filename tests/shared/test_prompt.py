"""The one reading of "the prompt" that the middleware and the emulator share."""

from __future__ import annotations

import json

from promptlb.emulator._prompt import prompt_blocks
from promptlb.middleware._affinity import prompt_head as affinity_head
from promptlb.shared import (
    BLOCK_BYTES,
    block_hashes,
    prompt_bytes,
    prompt_prefix,
    prompt_tokens,
    prompt_turns,
)


def test_turns_read_text_content_and_text_parts_in_order() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, "junk part"]},
            {"role": "assistant", "content": None},  # neither content nor calls: nothing
            "junk",
            {"role": 3, "content": "odd role"},
        ]
    }
    assert list(prompt_turns(body)) == [
        ("system", ["be brief"]),
        ("user", ["a"]),
        ("", ["odd role"]),
    ]
    assert list(prompt_turns({"prompt": ["one", 2, "two"]})) == [(None, ["one"]), (None, ["two"])]
    assert list(prompt_turns({"prompt": [1, 2, 3]})) == []


def test_the_prefix_lays_out_roles_and_a_batch_is_its_first_prompt() -> None:
    chat = {"messages": [{"role": "system", "content": "s" * 10}, {"role": "user", "content": "u"}]}
    assert prompt_prefix(chat, 1000) == "system\n" + "s" * 10 + "\nuser\nu\n"
    assert prompt_prefix(chat, 8) == "system\ns"
    assert prompt_prefix({"prompt": ["first", "second"]}, 1000) == "first"


def test_the_emulator_blocks_the_prompt_the_middleware_reads() -> None:
    messages = [{"role": "system", "content": "x" * 600}, {"role": "user", "content": "hi"}]
    body = {"messages": messages}
    data = prompt_bytes(body)
    tokens, blocks = prompt_blocks(messages, chat=True)
    assert (tokens, blocks) == (prompt_tokens(data), block_hashes(data))
    assert len(blocks) == len(data) // BLOCK_BYTES
    # affinity's head is the start of what the engine caches
    routed = affinity_head(body, 512)
    assert routed is not None and data.decode().startswith(routed)
    assert prompt_blocks("y" * 600, chat=False) == prompt_blocks(["y" * 600, "z"], chat=False)
    ids_tokens, ids_blocks = prompt_blocks([1, 2, 3], chat=False)  # token ids: their JSON
    assert ids_tokens == 3 and ids_blocks == []


def test_tool_calls_and_non_text_parts_are_part_of_the_prompt() -> None:
    # Two agent histories that differ only in the call made were one prefix (assistant turns
    # with content null were skipped, role and calls), and so were two prompts that differ
    # only in an image: the emulator's cache hit where an engine's would miss.
    def history(name: str, arguments: str) -> dict[str, object]:
        call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
        return {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "result"},
            ]
        }

    f, g = prompt_bytes(history("f", "{}")), prompt_bytes(history("g", '{"x": 1}'))
    assert f == b"user\nq\nassistant\nf({})\ntool\nresult\n" and f != g

    def with_image(url: str) -> dict[str, object]:
        image = {"type": "image_url", "image_url": {"url": url}}
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}

    one, other = prompt_bytes(with_image("data:,1")), prompt_bytes(with_image("data:,2"))
    assert one.startswith(b"user\nhi<image_url:") and one != other
    assert one == prompt_bytes(with_image("data:,1"))  # the same image, the same prefix
    # The stand-ins are shorter than the JSON that carries them: a body under one coarse
    # block still has none (`middleware._prefix.body_blocks`).
    bare = {"messages": [{"role": "u", "content": [{"type": "image_url"}] * 40}]}  # no payload
    stringless = {"messages": [{"role": "u", "content": [{"type": "x", "x": 1}] * 60}]}
    empty = {"messages": [{"role": "u", "content": [{"type": "x", "x": ""}] * 60}]}
    short = {"messages": [{"role": "u", "content": [{"type": "x", "x": "a"}] * 60}]}
    for body in (history("f", "{}"), with_image("data:,1"), bare, stringless, empty, short):
        assert len(prompt_bytes(body)) <= len(json.dumps(body, separators=(",", ":")))
