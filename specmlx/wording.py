"""How numbers read in what specmlx prints: sizes in binary units, counts with their noun.

One place, so that every command says a size the same way (a model's bytes on disk, the
memory it takes, the space a conversion needs) and no line reads "1 tokens".
"""

from __future__ import annotations

# Binary units throughout: memory and files are allocated in powers of two, and mixing
# GB with GiB in one tool makes the same size look like two.
UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit that keeps the number under 1024: "512 B",
    "513.5 KiB", "2.5 GiB"."""
    size = float(n)
    for unit in UNITS[:-1]:
        # Rounded as it will print: 1023.96 KiB reads as 1.0 MiB, not 1024.0 KiB.
        if abs(round(size, 1)) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} {UNITS[-1]}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it takes: "1 token", "3 tokens", "1 reply"
    (`plural`: where adding an s is wrong, e.g. "replies")."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
