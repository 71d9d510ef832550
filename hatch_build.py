"""Hatchling build hook: compile specmlx/cpu/_native (the INT4 CPU kernel) on Linux x86_64.

The package stays installable everywhere. On other platforms, or when the compile fails
(no compiler, no cmake), the hook warns and the wheel is pure Python; specmlx.cpu.native then
says why and falls back to mx.quantized_matmul. SPECMLX_BUILD_NATIVE=1 makes a failure
fatal (CI), SPECMLX_BUILD_NATIVE=0 skips the build.

The extension links against one exact mlx release, so pyproject.toml pins mlx on Linux
and lists it, with the matching nanobind, in build-system.requires; the build then only
needs the package index, never the network otherwise.

`python hatch_build.py` rebuilds in place with the current environment's mlx and nanobind
(for kernel development; needs `pip install nanobind==3.1.0 cmake ninja` there).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script, outside a build
    BuildHookInterface = object

ROOT = Path(__file__).resolve().parent
NATIVE = ROOT / "specmlx" / "cpu" / "_native"
BUILD_INFO = "_ext_build.json"


def unsupported_reason() -> str | None:
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "amd64"):
        return f"the native kernel is built only on Linux x86_64, not {sys.platform} {machine}"
    if shutil.which("cmake") is None:
        return "cmake not found"
    return None


def build_native(out_dir: Path = NATIVE) -> list[Path]:
    """Configure and build in a fresh directory; returns the files written to out_dir."""

    def tool_dir(module: str, flag: str) -> str:
        cmd = [sys.executable, "-m", module, flag]
        return subprocess.check_output(cmd, text=True).strip()

    mlx_cmake = Path(tool_dir("mlx", "--cmake-dir")) / "share" / "cmake" / "MLX"
    nanobind_cmake = tool_dir("nanobind", "--cmake_dir")
    cmake = shutil.which("cmake")
    jobs = os.environ.get("SPECMLX_BUILD_JOBS", str(min(os.cpu_count() or 1, 4)))
    with tempfile.TemporaryDirectory(prefix="specmlx-native-") as build_dir:
        configure = [
            cmake,
            "-S",
            str(NATIVE),
            "-B",
            build_dir,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DMLX_DIR={mlx_cmake}",
            f"-Dnanobind_DIR={nanobind_cmake}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        subprocess.run(configure, check=True)
        subprocess.run([cmake, "--build", build_dir, "--parallel", jobs], check=True)
    built = [out_dir / ("_ext" + sysconfig.get_config_var("EXT_SUFFIX")), out_dir / BUILD_INFO]
    missing = [str(p) for p in built if not p.exists()]
    if missing:
        raise OSError(f"build finished without {', '.join(missing)}")
    return built


class NativeBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        mode = os.environ.get("SPECMLX_BUILD_NATIVE", "auto")
        if mode == "0":
            return
        reason = unsupported_reason()
        if reason is None:
            # pip shows a build hook's output only with -v (its spinner reads "Preparing
            # editable metadata" meanwhile, as hatchling builds the wheel to get it there).
            sources = sorted(p.name for p in NATIVE.glob("*.cpp"))
            self.app.display_info(
                f"specmlx: compiling the native INT4 CPU kernel ({', '.join(sources)} in "
                f"{NATIVE.relative_to(ROOT)}, and nanobind's library)"
            )
            started = time.monotonic()
            try:
                built = build_native()
            except (OSError, subprocess.CalledProcessError) as e:
                reason = f"build failed: {e}"
            else:
                seconds = time.monotonic() - started
                self.app.display_info(f"specmlx: native kernel compiled in {seconds:.0f} s")
        if reason is not None:
            if mode == "1":
                raise RuntimeError(f"specmlx native kernel: {reason}")
            self.app.display_warning(
                f"specmlx: not building the native INT4 kernel ({reason}); "
                "specmlx will use mx.quantized_matmul"
            )
            return
        # The .so is ignored by git (so by hatchling's file selection); add it explicitly.
        # An editable install imports it from the source tree, where it was built.
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":
            for path in built:
                build_data["force_include"][str(path)] = f"specmlx/cpu/_native/{path.name}"


if __name__ == "__main__":
    why = unsupported_reason()
    if why:
        sys.exit(why)
    for path in build_native():
        print(path)
