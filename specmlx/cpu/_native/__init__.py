"""Native INT4 CPU kernel (C++ MLX extension); use it through specmlx.cpu.native."""
