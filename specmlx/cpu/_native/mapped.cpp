// Arrays over a mapped file. MLX 0.32's `array(void*, shape, dtype, deleter)` copies on the
// CPU (its CPU allocator's make_buffer makes no buffer from a foreign pointer), so the
// arrays are built from an allocator::Data instead: a Buffer plus a deleter that drops a
// shared reference to the mapping. The CPU-only build's Buffer points at an 8-byte size
// header, and raw_ptr() (what array::data() reads) is that pointer + 8: a tensor at offset
// o is a Buffer at o - 8. The header bytes there are the file's (the end of the tensor
// before, or of the JSON header: every tensor starts at least 8 bytes into the file), so
// what allocator().size() would read is garbage. Only two things read it, checked against
// mlx 0.32's sources: donation (is_donatable(in, out)), which first asks in.is_donatable(),
// false for Data that the allocator does not own, and Contiguous::eval_cpu, where a garbage
// size only decides between sharing the buffer and copying it (both correct). No op writes
// to an input it may not donate, and the mapping is PROT_READ, so a write would fault
// rather than change the file's pages.
#include "mapped.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace specmlx {
namespace {

struct Mapping {
  void* base = nullptr;
  size_t size = 0;
  Mapping(void* b, size_t s) : base(b), size(s) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (base != nullptr) {
      munmap(base, size);
    }
  }
};

std::string errno_text(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

std::shared_ptr<Mapping> map_file(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw std::invalid_argument(errno_text("cannot open", path));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int saved = errno;
    close(fd);
    errno = saved;
    throw std::invalid_argument(errno_text("cannot stat", path));
  }
  size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    close(fd);
    throw std::invalid_argument(path + " is empty");
  }
  void* base = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  int saved = errno;
  close(fd);  // the mapping keeps the file open
  if (base == MAP_FAILED) {
    errno = saved;
    throw std::invalid_argument(errno_text("cannot map", path));
  }
  // Start reading the file now (asynchronously) on a cold page cache: the first forward
  // touches every page anyway.
  madvise(base, size, MADV_WILLNEED);
  return std::make_shared<Mapping>(base, size);
}

}  // namespace

std::string mapping_unsupported() {
  // A CPU-only build lays a buffer out as [size_t size][data]; check that raw_ptr() says
  // so on a scratch pointer rather than assume it (it dereferences nothing there).
  alignas(16) static char probe[16];
  mx::allocator::Buffer buffer(probe);
  if (buffer.raw_ptr() != probe + sizeof(size_t)) {
    return "this mlx build's CPU buffers are not laid out as [size][data]";
  }
  return "";
}

std::vector<std::optional<mx::array>> map_tensors(
    const std::string& path, const std::vector<MappedTensor>& tensors) {
  std::string why = mapping_unsupported();
  if (!why.empty()) {
    throw std::invalid_argument(why);
  }
  auto mapping = map_file(path);
  std::vector<std::optional<mx::array>> arrays;
  arrays.reserve(tensors.size());
  for (const auto& [offset, dims, dtype] : tensors) {
    uint64_t elements = 1;
    for (int32_t d : dims) {
      if (d < 0 || (d > 0 && elements > UINT64_MAX / static_cast<uint64_t>(d))) {
        throw std::invalid_argument("a tensor shape of " + path + " is negative or overflows");
      }
      elements *= static_cast<uint64_t>(d);
    }
    if (elements > UINT64_MAX / mx::size_of(dtype)) {
      throw std::invalid_argument("a tensor shape of " + path + " overflows");
    }
    uint64_t bytes = elements * mx::size_of(dtype);
    if (offset < sizeof(size_t) || offset > mapping->size || bytes > mapping->size - offset) {
      throw std::invalid_argument(
          "tensor at byte " + std::to_string(offset) + " (" + std::to_string(bytes) +
          " bytes) lies outside " + path + " (" + std::to_string(mapping->size) + " bytes)");
    }
    if (offset % kMappedAlignment != 0) {
      arrays.emplace_back(std::nullopt);
      continue;
    }
    char* data = static_cast<char*>(mapping->base) + offset;
    mx::allocator::Data held(
        mx::allocator::Buffer(data - sizeof(size_t)), [mapping](mx::allocator::Buffer) {});
    arrays.emplace_back(mx::array(std::move(held), mx::Shape(dims.begin(), dims.end()), dtype));
  }
  return arrays;
}

}  // namespace specmlx
