"""What the cache keeps of an answer: the rule for a 200 that carries an error."""

from __future__ import annotations

from promptlb.middleware._replies import carries_error


def test_a_200_carries_an_error_by_its_shape_never_by_an_error_key_that_is_null() -> None:
    assert carries_error({"error": {"message": "overloaded"}})  # OpenAI's
    assert carries_error({"error": "overloaded", "error_type": "Overloaded"})  # TEI's
    assert carries_error({"object": "error", "message": "overloaded"})  # vLLM's older
    # The Responses API's objects always carry "error": null: an answer.
    assert not carries_error({"object": "response", "error": None, "output": []})
    assert not carries_error({"choices": [], "error": {"message": "partial"}})
    assert not carries_error({"object": "list", "data": [], "error": "x"})
    assert not carries_error(["error"]) and not carries_error(None)
