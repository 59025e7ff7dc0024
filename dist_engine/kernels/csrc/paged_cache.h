// Shared by the attention kernels that read the paged KV cache through raw pointers.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace lockstep {

// Every block the first `context` tokens of sequence `seq` occupy must exist in a cache of
// `num_blocks` blocks: `table` is that sequence's row of `num_columns` block ids.
inline void check_context_blocks(const char* kernel, int64_t seq, const int64_t* table,
                                 int64_t num_columns, int64_t context, int64_t block_size,
                                 int64_t num_blocks) {
  TORCH_CHECK(context <= num_columns * block_size, kernel, ": context length ", context,
              " of sequence ", seq, " outside its block table");
  for (int64_t c = 0; c < (context + block_size - 1) / block_size; ++c) {
    TORCH_CHECK(table[c] >= 0 && table[c] < num_blocks, kernel, ": sequence ", seq,
                " names block ", table[c], " of a cache with ", num_blocks, " blocks");
  }
}

}  // namespace lockstep
