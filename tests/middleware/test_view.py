"""A node as the strategies see it: what its snapshot says of its load."""

from __future__ import annotations

import pytest

from tests.middleware.conftest import MakeNode


def test_gpu_use_is_the_mean_of_the_cards_that_report_one(node: MakeNode) -> None:
    # A card in MIG mode has no utilisation (None): averaged as it was, it raised TypeError.
    assert node("a", gpus=[0.9, None, 0.5]).gpu_util == pytest.approx(0.7)
    assert node("a", gpus=[None, None]).gpu_util is None
    assert node("a", gpus=[]).gpu_util is None
