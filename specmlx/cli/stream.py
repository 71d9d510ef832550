"""Streaming a Generation for `generate` and `chat`: text cut at stop strings, per-round notes.

Both read only what the engine hands out (Steps, and the Stats it updates as it goes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..stops import StopText


def stop_pieces(gen, stops: list[str]) -> Iterator[tuple[object | None, str]]:
    """Each Step of `gen` with the text safe to show for it, then (None, the rest) once the
    generation ends: text that may begin a stop string is held back until the next piece
    settles it, and at the first stop string the stream ends, the stop itself never shown.
    Whether one was reached: `reached_stop`."""
    stop = StopText(stops)
    streamed = 0
    for step in gen:
        streamed += len(step.text)
        text, cut = stop.add(step.text)
        yield step, text
        if cut:
            return
    # What the detokenizer held back until the last token was known (after an EOS).
    text, cut = stop.add(gen.text[streamed:])
    yield None, text if cut else text + stop.flush()


def reached_stop(gen, stops: list[str]) -> bool:
    """Whether a stop string cut `gen` short: the text it emitted holds one only then, as
    stop_pieces ends the stream at the first."""
    return any(stop in gen.text for stop in stops)


def check_stops(stops: list[str] | None) -> list[str]:
    from ..errors import SpecmlxError
    from .options import command_line_text

    stops = [command_line_text(stop, "--stop") for stop in stops or []]
    if "" in stops:
        raise SpecmlxError("--stop needs a non-empty string")
    return stops


def round_notes(stats, note: Callable[[str], None]) -> Callable[[], None]:
    """A function to call after each step and once at the end: it notes every round finished
    since its last call (γ used, or a tree's size and the shape the policy chose, drafts
    accepted: the accepted length, where they came from, draft and verify times), from
    the differences in the Stats the engine fills in round by round."""
    last = {"passes": 0, "accepted": 0, "draft_s": 0.0, "verify_s": 0.0}
    last_gamma: dict[int, int] = {}
    last_source: dict[str, int] = {}
    last_shape: dict[str, int] = {}

    def grown(now: dict, before: dict) -> list:
        return [key for key, n in now.items() if n > before.get(key, 0)]

    def notes() -> None:
        passes = stats.target_passes
        if passes == last["passes"]:
            return
        rounds = passes - last["passes"]
        gammas = "/".join(map(str, grown(stats.rounds_by_gamma, last_gamma)))
        sources = "/".join(grown(stats.rounds_by_source, last_source))
        drafted = sum(g * (n - last_gamma.get(g, 0)) for g, n in stats.rounds_by_gamma.items())
        label = f"round {passes}" if rounds == 1 else f"rounds {last['passes'] + 1}-{passes}"
        shapes = "/".join(grown(stats.rounds_by_shape, last_shape))
        size = f"tree {shapes} = {gammas} nodes" if shapes else f"γ {gammas}"
        note(
            f"{label}: {size} ({sources}) · accepted {stats.accepted - last['accepted']}"
            f"/{drafted} · draft {(stats.draft_time - last['draft_s']) * 1e3:.1f} ms · "
            f"verify {(stats.verify_time - last['verify_s']) * 1e3:.1f} ms"
        )
        last.update(
            passes=passes,
            accepted=stats.accepted,
            draft_s=stats.draft_time,
            verify_s=stats.verify_time,
        )
        last_gamma.update(stats.rounds_by_gamma)
        last_source.update(stats.rounds_by_source)
        last_shape.update(stats.rounds_by_shape)

    return notes
