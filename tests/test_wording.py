"""How specmlx says a size or a count: binary units everywhere, the noun in its number."""

from __future__ import annotations

import pytest

from specmlx.wording import counted, human_bytes


@pytest.mark.parametrize(
    ("n", "reads"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (525_824, "513.5 KiB"),
        (1_048_575, "1.0 MiB"),  # not "1024.0 KiB": the unit goes up where the number would
        (2.5 * 2**30, "2.5 GiB"),
        (3 * 2**40, "3.0 TiB"),
    ],
)
def test_sizes_read_in_binary_units(n, reads):
    assert human_bytes(n) == reads


@pytest.mark.parametrize(
    ("n", "noun", "plural", "reads"),
    [
        (1, "token", None, "1 token"),
        (0, "token", None, "0 tokens"),
        (2, "turn", None, "2 turns"),
        (1, "reply", "replies", "1 reply"),
        (3, "reply", "replies", "3 replies"),
    ],
)
def test_a_count_takes_the_noun_in_its_number(n, noun, plural, reads):
    assert counted(n, noun, plural) == reads
