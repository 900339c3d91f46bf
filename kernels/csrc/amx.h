// AMX tiles for the CPU kernels: whether this process may use them, and the tile configuration ldtilecfg reads.
// A kernel uses tiles only where the CPU has them (compiled with -march=native on an AMX CPU) and Linux grants the
// process their state (ARCH_REQ_XCOMP_PERM for XTILEDATA); a VM that hides them gets the kernels' vector paths.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define K3_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace k3 {

constexpr int TILE_ROWS = 16;  // rows of a tile; a row holds at most 64 bytes

inline bool amx_permitted() {  // asked of the kernel once a process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {  // ldtilecfg's 64 bytes: palette 1, then each tile's bytes a row and rows
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// palette 1 with tiles 0 .. n - 1 of rows[t] rows and colsb[t] bytes a row (this thread's state)
inline void configure_tiles(int n, const uint8_t* rows, const uint16_t* colsb) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < n; ++t) c.colsb[t] = colsb[t], c.rows[t] = rows[t];
  asm volatile("" : : "r"(&c) : "memory");  // GCC does not see ldtilecfg read the stores: keep them
  _tile_loadconfig(&c);
}

}  // namespace k3
#endif
