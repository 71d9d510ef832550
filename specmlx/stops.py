"""Stop strings: the text is cut where the first one begins, and none is ever emitted.

Text streams out as it is decoded, except a tail that could still grow into a stop
string: that is held back until the next piece either completes the stop (and is cut)
or rules it out (and is sent).
"""

from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""

    def add(self, text: str) -> tuple[str, bool]:
        """The text that is safe to send now, and whether a stop string was reached."""
        text = self.held + text
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            return text[: min(found)], True
        keep = _partial_stop(text, self.stops)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """What was held back, once no more text will come."""
        held, self.held = self.held, ""
        return held


def _partial_stop(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that begins some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
