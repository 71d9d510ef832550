// Arrays over a mapped file. MLX 0.32's `array(void*, shape, dtype, deleter)` copies on the
// CPU (its CPU allocator's make_buffer makes no buffer from a foreign pointer), so the
// arrays are built from an allocator::Data instead: a Buffer plus a deleter that drops a
// reference to the tensor's mapping.
//
// The CPU-only build lays a buffer out as [size_t size][data]: Buffer points at the size,
// raw_ptr() (what array::data() reads) is that pointer + 8, and allocator().size() reads
// the size. It must be right: Contiguous::eval_cpu (mx::contiguous, which the native kernel
// calls on its weights) shares an input's buffer only when that size is at most the
// output's bytes + 16 KiB, and copies the whole input otherwise, so a wrong size would copy
// every weight at every call. In the file the 8 bytes before a tensor are the end of the
// one before it (or of the JSON header), so each tensor gets a private (copy-on-write)
// mapping of its own pages, the tensor's byte count is written in front of it there (one
// page per tensor becomes private: 4 KiB), and the mapping is then made read-only. Where
// the file already holds the count there (specmlx.aligned's copies pad each tensor so that
// it does), nothing is written and no page becomes private (see map_whole). The other
// thing that reads the size, donation (is_donatable(in, out)), first asks
// in.is_donatable(), which is false for Data that the allocator does not own: no op writes
// into a mapped tensor, and a write would fault.
#include "mapped.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>

namespace specmlx {
namespace {

struct Mapping {
  void* base = nullptr;
  size_t size = 0;
  Mapping(void* b, size_t s) : base(b), size(s) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    munmap(base, size);
  }
};

struct File {
  int fd = -1;
  explicit File(const std::string& path) : fd(open(path.c_str(), O_RDONLY | O_CLOEXEC)) {}
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd >= 0) {
      close(fd);  // the mappings keep the file open
    }
  }
};

std::string errno_text(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

uint64_t tensor_bytes(const std::string& path, const std::vector<int32_t>& dims, mx::Dtype dtype) {
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
  return elements * mx::size_of(dtype);
}

// Whether the 8 bytes before the tensor at `offset` hold its byte count already.
bool size_in_file(int fd, uint64_t offset, uint64_t bytes) {
  size_t in_file = 0;
  return pread(fd, &in_file, sizeof(in_file), static_cast<off_t>(offset - sizeof(size_t))) ==
      static_cast<ssize_t>(sizeof(in_file)) &&
      in_file == static_cast<size_t>(bytes);
}

// The pages holding [offset - 8, offset + bytes), privately mapped, with `bytes` written in
// the 8 bytes before the tensor (unless the file holds it there already): an
// allocator-shaped buffer whose data is the file's. Returns the mapping and where the
// tensor's data lies in it.
std::pair<std::shared_ptr<Mapping>, char*> map_tensor(
    const std::string& path, int fd, uint64_t offset, uint64_t bytes) {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t header = offset - sizeof(size_t);
  const uint64_t start = header / page * page;
  const size_t length = static_cast<size_t>(offset + bytes - start);
  const size_t size = static_cast<size_t>(bytes);
  const bool written = size_in_file(fd, offset, bytes);
  const int prot = written ? PROT_READ : PROT_READ | PROT_WRITE;
  void* base = mmap(nullptr, length, prot, MAP_PRIVATE, fd, static_cast<off_t>(start));
  if (base == MAP_FAILED) {
    throw std::invalid_argument(errno_text("cannot map", path));
  }
  auto mapping = std::make_shared<Mapping>(base, length);
  if (!written) {
    std::memcpy(static_cast<char*>(base) + (header - start), &size, sizeof(size));
    if (mprotect(base, length, PROT_READ) != 0) {
      throw std::invalid_argument(errno_text("cannot make read-only a mapping of", path));
    }
  }
  return {mapping, static_cast<char*>(base) + (offset - start)};
}

// A file whose every tensor already has its size in front (specmlx.aligned's) needs no
// private page, so it is mapped once, whole, read-only. The page cache's large folios
// (specmlx.aligned writes its files a whole aligned 2 MiB at a time to get them) are
// mapped as 2 MiB pages only where a mapping covers a whole aligned 2 MiB of the file: a
// mapping per tensor loses the part of one at each end of every tensor to 4 KiB pages, one
// mapping of the file loses none. The cost: the mapping lives until the last array over
// any of its tensors is freed.
std::shared_ptr<Mapping> map_whole(const std::string& path, int fd, uint64_t file_size) {
  void* base = mmap(nullptr, static_cast<size_t>(file_size), PROT_READ, MAP_PRIVATE, fd, 0);
  if (base == MAP_FAILED) {
    throw std::invalid_argument(errno_text("cannot map", path));
  }
  madvise(base, static_cast<size_t>(file_size), MADV_HUGEPAGE);  // advice: failure is harmless
  return std::make_shared<Mapping>(base, static_cast<size_t>(file_size));
}

// The first forward touches nearly every page: fault them in (reading the file, on a cold
// page cache) on a thread of their own while the caller goes on to the tokenizer and the
// other model, instead of page by page inside that forward. The thread holds the mappings
// until it is done.
void populate_in_background(std::vector<std::shared_ptr<Mapping>> mappings) {
  std::thread([mappings = std::move(mappings)] {
    for (const auto& m : mappings) {
#ifdef MADV_POPULATE_READ
      if (madvise(m->base, m->size, MADV_POPULATE_READ) == 0) {
        continue;
      }
#endif
      madvise(m->base, m->size, MADV_WILLNEED);  // kernels before 5.14: readahead only
    }
  }).detach();
}

}  // namespace

std::string mapping_unsupported() {
  // Check that raw_ptr() is the pointer + 8 on a scratch buffer rather than assume it (it
  // dereferences nothing there).
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
  File file(path);
  if (file.fd < 0) {
    throw std::invalid_argument(errno_text("cannot open", path));
  }
  struct stat st {};
  if (fstat(file.fd, &st) != 0) {
    throw std::invalid_argument(errno_text("cannot stat", path));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  std::vector<uint64_t> sizes;
  bool whole = !tensors.empty();
  for (const auto& [offset, dims, dtype] : tensors) {
    const uint64_t bytes = tensor_bytes(path, dims, dtype);
    if (offset < sizeof(size_t) || offset > file_size || bytes > file_size - offset) {
      throw std::invalid_argument(
          "tensor at byte " + std::to_string(offset) + " (" + std::to_string(bytes) +
          " bytes) lies outside " + path + " (" + std::to_string(file_size) + " bytes)");
    }
    sizes.push_back(bytes);
    whole = whole && offset % kMappedAlignment == 0 && size_in_file(file.fd, offset, bytes);
  }
  std::vector<std::optional<mx::array>> arrays;
  std::vector<std::shared_ptr<Mapping>> mappings;
  arrays.reserve(tensors.size());
  if (whole) {
    mappings.push_back(map_whole(path, file.fd, file_size));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [offset, dims, dtype] = tensors[i];
    if (offset % kMappedAlignment != 0) {
      arrays.emplace_back(std::nullopt);
      continue;
    }
    std::shared_ptr<Mapping> mapping;
    char* data = nullptr;
    if (whole) {
      mapping = mappings.front();
      data = static_cast<char*>(mapping->base) + offset;
    } else {
      std::tie(mapping, data) = map_tensor(path, file.fd, offset, sizes[i]);
      mappings.push_back(mapping);
    }
    mx::allocator::Data held(
        mx::allocator::Buffer(data - sizeof(size_t)), [mapping](mx::allocator::Buffer) {});
    arrays.emplace_back(mx::array(std::move(held), mx::Shape(dims.begin(), dims.end()), dtype));
  }
  populate_in_background(std::move(mappings));
  return arrays;
}

}  // namespace specmlx
