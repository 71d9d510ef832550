// MLX arrays over a read-only mapping of a file: a safetensors checkpoint's tensors used in
// place, so the weights live in the page cache (shared by every process on the same model)
// instead of in a private copy per process.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "mlx/mlx.h"

namespace specmlx {

namespace mx = mlx::core;

// Where one tensor lies in the file: absolute byte offset, shape, dtype.
using MappedTensor = std::tuple<uint64_t, std::vector<int32_t>, mx::Dtype>;

// Why arrays cannot be built over a mapping with this mlx build ("" when they can).
std::string mapping_unsupported();

// The alignment MLX's CPU allocator itself gives (malloc's 16 plus its 8-byte size header,
// so 8 mod 16): nothing in MLX can assume more of a buffer than that.
constexpr uint64_t kMappedAlignment = 8;

// Map `path` read-only and return, per tensor, an array over its own mapping of the file's
// pages (no copy), or nullopt where its offset is not a multiple of kMappedAlignment (the
// caller copies it); where every tensor already has its byte count in the 8 bytes before
// it, one mapping of the whole file serves them all. A mapping is unmapped when the last
// array (or view of one) using it is freed; a background thread faults the pages in
// meanwhile. Every range is checked against the file's size at mapping time
// (std::invalid_argument): a file cut since its header was read would otherwise be a
// SIGBUS at the first touch.
std::vector<std::optional<mx::array>> map_tensors(
    const std::string& path, const std::vector<MappedTensor>& tensors);

} // namespace specmlx
