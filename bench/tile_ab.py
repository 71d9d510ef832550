"""Two builds of the int8-activation kernels side by side, without MLX: bench/tile_ab.cpp.

A whole op through MLX pays ~0.1 ms of dispatch a call on this project's VMs, and a model's
step mixes every kernel; this times the AVX2 tiles alone, through their driver
(qmm_rows_q8), both builds in one process, interleaved, and checks that their outputs are
bitwise equal. A and B are directories holding a kernels_q8.cpp with its kernels.h,
amx.h and scratch.h (two checkouts' specmlx/cpu/_native).

    python bench/tile_ab.py --b /tmp/variant/specmlx/cpu/_native            # 4-bit, DRAM
    python bench/tile_ab.py --b DIR --bits 8 --rows 151936 --cols 1536      # the 1.5B head
    python bench/tile_ab.py --b DIR --rows 64 --threads 1 --rounds 30       # in cache

Needs g++ with C++20 and an AVX2 CPU (the tiles run on AVX2 whatever the CPU has more).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
NATIVE = HERE.parent / "specmlx" / "cpu" / "_native"


def one_unit(directory: Path) -> str:
    """kernels_q8.cpp with its own headers pasted in, so that two builds can live in one
    program, each under its own namespace (the headers' include guards would let only the
    first build declare its types)."""
    header = {
        n: (directory / n).read_text().replace("#pragma once", "")
        for n in ("kernels.h", "amx.h", "scratch.h")
    }
    source = (directory / "kernels_q8.cpp").read_text()
    amx = header["amx.h"].replace('#include "kernels.h"', "")
    source = source.replace('#include "amx.h"', header["kernels.h"] + amx)
    source = source.replace('#include "kernels.h"', "").replace(
        '#include "scratch.h"', header["scratch.h"]
    )
    return source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--a", type=Path, default=NATIVE, help="build A's sources (default: this tree's)"
    )
    parser.add_argument("--b", type=Path, required=True, help="build B's sources")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument(
        "--rows", type=int, default=8960 * 28, help="N (default: 28 gate projections)"
    )
    parser.add_argument("--cols", type=int, default=1536, help="K")
    parser.add_argument("--threads", type=int, choices=(1, 2), default=2)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    mlx_dir = Path(
        subprocess.check_output([sys.executable, "-m", "mlx", "--cmake-dir"], text=True).strip()
    )
    with tempfile.TemporaryDirectory(prefix="tile-ab-") as tmp:
        units = []
        for name, directory in (("va.cpp", args.a), ("vb.cpp", args.b)):
            path = Path(tmp) / name
            path.write_text(one_unit(directory))
            units.append(path)
        # amx.cpp is not compiled in: the AVX2 tiles never call it.
        stub = Path(tmp) / "stub.cpp"
        stub.write_text(
            "namespace va { struct QmmJob; void qmm_rows_amx(const QmmJob&, int, int) {} }\n"
            "namespace vb { struct QmmJob; void qmm_rows_amx(const QmmJob&, int, int) {} }\n"
        )
        binary = Path(tmp) / "tile_ab"
        compile_cmd = [
            "g++", "-std=c++20", "-O3", "-pthread", "-Wno-maybe-uninitialized",
            f'-DVA="{units[0]}"', f'-DVB="{units[1]}"', f"-I{mlx_dir / 'include'}",
            str(HERE / "tile_ab.cpp"), str(stub), "-o", str(binary),
            f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}",
        ]  # fmt: skip
        subprocess.run(compile_cmd, check=True)
        print(f"A = {args.a}\nB = {args.b}", flush=True)
        sizes = (args.bits, args.rows, args.cols, args.threads, args.rounds)
        run = [str(binary), *map(str, sizes)]
        subprocess.run(run, check=True)


if __name__ == "__main__":
    main()
