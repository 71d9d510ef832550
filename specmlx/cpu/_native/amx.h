// The AMX tile for INT4 weights x int8 activations (amx.cpp), for passes over many rows.
#pragma once

#include "kernels.h"

namespace specmlx {

// Rows of x from which a 4-bit int8 matmul runs on AMX: below, the VNNI quad tile (same
// results, bitwise) takes them without the tiles' set-up.
constexpr int kAmxMinRows = 16;

bool amx_available();  // the CPU has AMX-INT8 and Linux granted this process its tile data
bool amx_enabled();    // available, and not switched off by set_amx(false)
void set_amx(bool on);

// Whether job j (x quantized, 4 bits) runs on AMX under isa.
bool amx_rows(const QmmJob& j, Isa isa);

// x's codes and scales, already in j.xq / xd / xs, also in the AMX tiles' layout (into this
// thread's scratch; j.xb / xdt / xst point at it).
void prepare_x_amx(QmmJob& j);

// Output rows [n0, n1) for all M rows of x. Safe to call concurrently on disjoint ranges.
void qmm_rows_amx(const QmmJob& j, int n0, int n1);

} // namespace specmlx
