// AMX tiles for the CPU ops that use them (linear_rows, mla_decode): whether this process may, and the tile
// configuration. Tiles multiply 16 rows of bf16 values by pairs of bf16 (exact products, fp32 sums): the same dot
// products as vdpbf16ps, 16 rows x up to 16 columns x 32 values an instruction.
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

inline bool amx_permitted() {  // asked of the kernel once a process (ARCH_REQ_XCOMP_PERM for XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {  // ldtilecfg's 64 bytes: palette 1, then each tile's bytes a row and rows
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// This thread's tiles 0 .. n-1 as (bytes a row, rows); the rest unused
inline void configure_tiles(const uint16_t* colsb, const uint8_t* rows, int n) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < n; ++t) c.colsb[t] = colsb[t], c.rows[t] = rows[t];
  asm volatile("" : : "r"(&c) : "memory");  // GCC does not see ldtilecfg read the stores: keep them
  _tile_loadconfig(&c);
}

}  // namespace k3
#endif
