"""The one reading of "the prompt" that the middleware and the emulator share."""

from __future__ import annotations

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
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
            {"role": "assistant", "content": None},  # a tool call: no text
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
