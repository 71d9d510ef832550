"""The modes a run compares (target alone, specmlx and mlx-lm at each γ), parsed from the
command line, and the interleaved order they run in."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..drafters import AUTO
from ..drafters import modes as draft_modes
from ..errors import SpecmlxError
from ..settings import DEFAULT_SAMPLING, SAMPLINGS
from .suite import Prompt


@dataclass(frozen=True)
class Mode:
    engine: str  # "specmlx" | "mlx-lm"
    gamma: int | str  # draft tokens per round; 0 = the target alone; "auto" = specmlx decides
    # specmlx: "auto" (prompt n-grams where they match, else the draft model: generate()'s
    # default with a draft model) | "model" | "lookup"
    draft_mode: str = AUTO
    # The target alone a second time, timed as a mode of its own: an A/A test whose
    # "speedup" is what this machine's noise alone makes of two identical modes.
    control: bool = False
    sampling: str = DEFAULT_SAMPLING  # specmlx at T > 0: settings.SAMPLINGS

    @property
    def family(self) -> str:
        """The mode without its γ: 'specmlx' (its default drafts and sampling),
        'specmlx/model', 'specmlx/lookup', 'specmlx/coupled', 'mlx-lm'."""
        if self.engine != "specmlx":
            return self.engine
        parts = [self.engine]
        parts += [self.draft_mode] if self.draft_mode != AUTO else []
        parts += [self.sampling] if self.sampling != DEFAULT_SAMPLING else []
        return "/".join(parts)

    @property
    def name(self) -> str:
        if self.engine == "specmlx" and self.gamma == 0:
            return "target:again" if self.control else "target"
        return f"{self.family}:{self.gamma}"

    @property
    def speculative(self) -> bool:
        return self.gamma != 0


TARGET = Mode("specmlx", 0)
CONTROL = Mode("specmlx", 0, control=True)


def parse_draft_modes(text: str) -> list[str]:
    """'model,lookup' -> ['model', 'lookup'], each one of specmlx's draft modes."""
    modes = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not modes or any(m not in draft_modes() for m in modes):
        raise SpecmlxError(
            f"--draft-mode takes {', '.join(draft_modes())} (comma-separated), got {text!r}"
        )
    return modes


def parse_gammas(text: str, allow_auto: bool = True) -> list[int | str]:
    """'1,2,4,6' or 'auto,4' -> [1, 2, 4, 6] / ['auto', 4]; γ = 0 is the target alone.

    `allow_auto=False` for mlx-lm's γs: it has no adaptive γ."""
    gammas: list[int | str] = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "auto":
            if not allow_auto:
                raise SpecmlxError(
                    "mlx-lm has no adaptive γ; give --mlx-lm-gamma integers, e.g. 1,2,4"
                )
            value: int | str = "auto"
        else:
            try:
                value = int(item)
            except ValueError:
                raise SpecmlxError(f"--gamma takes integers >= 1 or auto, got {item!r}") from None
            if value < 1:
                raise SpecmlxError(
                    f"--gamma values must be >= 1 (the target alone always runs), got {value}"
                )
        if value not in gammas:
            gammas.append(value)
    if not gammas:
        raise SpecmlxError("--gamma is empty; give e.g. 1,2,4,6")
    return gammas


def parse_temperatures(text: str) -> list[float]:
    """'0,0.7,1' -> [0.0, 0.7, 1.0], duplicates dropped."""
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SpecmlxError(
            f"--temperature takes numbers >= 0 like 0,0.7,1.0, got {text!r}"
        ) from None
    if not temps or any(t < 0 for t in temps):
        raise SpecmlxError(f"--temperature takes numbers >= 0 like 0,0.7,1.0, got {text!r}")
    return list(dict.fromkeys(temps))


def build_modes(
    gammas: list[int | str],
    mlx_lm: bool = True,
    mlx_lm_target: bool = False,
    draft_modes: Iterable[str] = ("auto",),
    mlx_lm_gammas: list[int] | None = None,
    control: bool = False,
    samplings: Iterable[str] = (DEFAULT_SAMPLING,),
) -> list[Mode]:
    """The target alone, specmlx at each draft mode and γ, mlx-lm at each integer γ
    (or at `mlx_lm_gammas`, e.g. to pit specmlx's auto against mlx-lm's best fixed γ);
    `control` adds the target alone again (CONTROL), the run's noise floor.

    mlx-lm has neither an automatic γ nor prompt lookup, so it runs fixed γ, model draft.
    """
    modes = [TARGET] + ([CONTROL] if control else [])
    modes += [
        Mode("specmlx", g, d, sampling=s) for s in samplings for d in draft_modes for g in gammas
    ]
    if mlx_lm_target:
        modes.append(Mode("mlx-lm", 0))
    if mlx_lm:
        fixed = mlx_lm_gammas or [g for g in gammas if isinstance(g, int)]
        modes += [Mode("mlx-lm", g) for g in fixed]
    return modes


def schedule(
    prompts: list[Prompt], temperatures: list[float], modes: list[Mode], repeat: int = 1
) -> list[tuple[Prompt, float, Mode]]:
    """Interleaved order: per prompt and temperature, every mode once, back to back,
    `repeat` blocks in a row.

    The mode order rotates by one from block to block, so no mode always runs first
    (after a cold cache, or right after the heaviest mode).
    """
    order = []
    blocks = ((p, t) for p in prompts for t in temperatures for _ in range(repeat))
    for block, (prompt, temp) in enumerate(blocks):
        shift = block % len(modes)
        order += [(prompt, temp, mode) for mode in modes[shift:] + modes[:shift]]
    return order


def parse_samplings(text: str) -> list[str]:
    """'rejection,coupled' -> ['rejection', 'coupled'], each one of settings.SAMPLINGS."""
    chosen = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not chosen or any(s not in SAMPLINGS for s in chosen):
        raise SpecmlxError(
            f"--sampling takes {', '.join(SAMPLINGS)} (comma-separated), got {text!r}"
        )
    return chosen
