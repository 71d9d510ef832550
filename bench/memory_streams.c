// How fast one thread reads weights in the orders a matmul tile can take them: the memory
// side of the native kernel's row pairing (bench/results/row_pairing.md), with no
// arithmetic. 1 GiB of rows of R bytes in blocks of B rows; a "tile" reads two rows chunk
// by chunk (64 bytes from each in turn), then the next pair:
//
//   sequential   the buffer front to back, no pairs
//   adjacent     rows (2i, 2i + 1) of each block: the kernel's pairing before
//   split        rows (i, i + B/2): two runs that go on through memory
//   +prefetch    software prefetch 4 KiB ahead in each of the two rows
//
//   cc -O2 -mavx512f -o /tmp/memory_streams bench/memory_streams.c   (or -mavx2)
//   /tmp/memory_streams [R B]       defaults: 768 bytes (a 1536-wide 4-bit row), B = 8960
//
// Prints GB/s per order, each the total over 7 rounds with the orders interleaved.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define BYTES (1ul << 30)

static __m256i sink;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void sequential(const char* b) {
  __m256i a = _mm256_setzero_si256();
  for (size_t c = 0; c < BYTES; c += 64) {
    a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i*)(b + c)));
  }
  sink = _mm256_xor_si256(sink, a);
}

static void pairs(const char* b, size_t row, size_t block, int split, int prefetch) {
  __m256i a = _mm256_setzero_si256();
  const size_t rows = BYTES / row, half = block / 2;
  for (size_t nb = 0; nb + block <= rows; nb += block) {
    for (size_t i = 0; i < half; ++i) {
      const size_t n0 = split ? nb + i : nb + 2 * i, n1 = split ? n0 + half : n0 + 1;
      const char *w0 = b + n0 * row, *w1 = b + n1 * row;
      for (size_t c = 0; c < row; c += 64) {
        if (prefetch) {
          _mm_prefetch(w0 + 4096 + c, _MM_HINT_T0);
          _mm_prefetch(w1 + 4096 + c, _MM_HINT_T0);
        }
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i*)(w0 + c)));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i*)(w1 + c)));
      }
    }
  }
  sink = _mm256_xor_si256(sink, a);
}

int main(int argc, char** argv) {
  const size_t row = argc > 1 ? strtoul(argv[1], 0, 10) : 768;
  const size_t block = argc > 2 ? strtoul(argv[2], 0, 10) : 8960;
  char* b = mmap(0, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (b == MAP_FAILED || row % 64 || block < 2) {
    fprintf(stderr, "need 1 GiB of memory, R a multiple of 64 and B >= 2\n");
    return 1;
  }
  memset(b, 1, BYTES);
  const char* names[] = {"sequential", "adjacent", "adjacent+prefetch", "split", "split+prefetch"};
  double seconds[5] = {0};
  for (int round = 0; round < 7; ++round) {
    for (int v = 0; v < 5; ++v) {
      const double t = now();
      if (v == 0) {
        sequential(b);
      } else {
        pairs(b, row, block, v >= 3, v % 2 == 0);
      }
      seconds[v] += now() - t;
    }
  }
  printf("rows of %zu bytes, blocks of %zu rows:", row, block);
  for (int v = 0; v < 5; ++v) {
    printf("  %s %.1f", names[v], 7.0 * BYTES / seconds[v] / 1e9);
  }
  printf(" GB/s\n");
  return 0;
}
